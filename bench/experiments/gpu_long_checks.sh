#!/usr/bin/env bash
# After gpu_conversation.sh on the same host (its model in $R8Q): the disk tier's hit against
# computing again (disk_tier_hit.py, ~15k tokens), and how far a kept prefix moves bfloat16
# logprobs (cache_invariance.py). Set-up and paths: gpu_env.sh; writes $OUT/disk_tier.json and
# prints both.
set -eu
source bench/experiments/gpu_env.sh
model_r8q
python3 -m bench.experiments.disk_tier_hit --model $R8Q --turns ${TURNS:-6} \
  --tool-words ${WORDS:-800} --json $OUT/disk_tier.json
OMLX_TEST_TOKENIZER_DIR=$TOK python3 -m bench.experiments.cache_invariance --model $R8Q
