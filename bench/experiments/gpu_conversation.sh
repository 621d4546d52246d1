#!/usr/bin/env bash
# The multi-turn agent trace on the GPU host (bench/conversation.py): a random llama in
# Llama-3-8B's shape, 4-bit, 32k context ($R8Q); 8 turns growing to ~24k tokens; ours with the
# prefix cache, ours without, mlx-lm's server. Set-up and paths: gpu_env.sh; writes
# $OUT/conversation.json and the servers' logs.
set -eu
source bench/experiments/gpu_env.sh
model_r8q
python3 -m bench.conversation --model $R8Q --turns ${TURNS:-8} --tool-words ${WORDS:-800} \
  --json $OUT/conversation.json --logs $OUT
