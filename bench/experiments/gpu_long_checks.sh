#!/usr/bin/env bash
# After gpu_conversation.sh on the same host (its model in /tmp/r8q): the disk tier's hit against
# computing again (disk_tier_hit.py, ~15k tokens), and how far a kept prefix moves bfloat16
# logprobs (cache_invariance.py). Writes $OUT/disk_tier.json and prints both.
set -eu
source /root/mlxenv.sh
export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 bench/experiments/disk_tier_hit.py --model /tmp/r8q --turns ${TURNS:-6} \
  --tool-words ${WORDS:-800} --json $OUT/disk_tier.json
OMLX_TEST_TOKENIZER_DIR=.gpu/tok python3 bench/experiments/cache_invariance.py --model /tmp/r8q
