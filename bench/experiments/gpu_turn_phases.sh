#!/usr/bin/env bash
# bench/experiments/turn_phases.py on the GPU host: a random llama in Llama-3-8B's shape, 4-bit
# ($R8Q), 8 turns growing by 2,900 tokens to ~23k; the server's defaults, bare mlx-lm on MLX's own
# attention. Set-up and paths: gpu_env.sh; writes $OUT/phases.json.
set -eu
source bench/experiments/gpu_env.sh
model_r8q
python3 -m bench.experiments.turn_phases --model $R8Q --turns ${TURNS:-8} --mlx-attention \
  --json $OUT/phases.json 2>&1 | grep -E "cuDNN|^turn|^bare|rror" | tail -40
