#!/usr/bin/env bash
# The multi-turn agent trace (bench/conversation.py) on a hybrid model, on the GPU host: a random
# Qwen3.5-shaped 9B (gated delta layers, every fourth full attention), 4-bit, 32k context, in
# $H9Q (default $MODELS/h9q); 8 turns growing to ~24k tokens; ours with the prefix cache
# (sequences kept whole with their states), ours without, mlx-lm's server (FLAGS: more
# bench/conversation.py flags). Set-up and paths: gpu_env.sh; writes $OUT/hybrid_conversation.json.
set -eu
source bench/experiments/gpu_env.sh
H9Q=${H9Q:-$MODELS/h9q}
date +"model: %T"; random_model $H9Q --size hybrid-9b --bits 4 --context 32768
date +"servers: %T"; python3 -m bench.conversation --model $H9Q --turns ${TURNS:-8} --tool-words ${WORDS:-800} \
  --json $OUT/hybrid_conversation.json --logs $OUT ${FLAGS:-}
