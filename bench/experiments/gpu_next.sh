#!/usr/bin/env bash
# Three open questions on the GPU host (docs/benchmarks.md, "Speculative decoding"), one job:
# 1. Why a one-row verify costs 3.4 plain steps: the verify's cost with a bfloat16 model (no
#    quantized matmul) against the same shapes in 4 bits (MLX's sm90 path takes its one-row
#    quantized kernel for exactly one row).
# 2. Whether speculation pays at c=8-32 on CUDA, where from two rows on the plain step already
#    pays for the tiled matmul: lookup with --speculate-max-batch 32 against off.
# Needs MLX (../shared/gpu/README.md), the web wheels in .whl/, SmolLM2's tokenizer in .gpu/tok/.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH CUDA_CACHE_MAXSIZE=4294967296
[ -f /tmp/r1/config.json ] || python3 bench/randmodel.py --out /tmp/r1 --tokenizer-from .gpu/tok \
  --size 1b --context 32768
[ -f /tmp/r1q/config.json ] || python3 -m mlx_lm convert --hf-path /tmp/r1 --mlx-path /tmp/r1q -q \
  --q-bits 4
for m in /tmp/r1 /tmp/r1q; do
  python3 bench/experiments/verify_cost.py --model $m --rows 1 2 8 --drafts 0 2 8 \
    --json $OUT/verify_$(basename $m).json
done
for c in 8 32; do
  python3 bench/speculation.py --model /tmp/r1q --max-tokens 128 --no-mlx-lm --concurrency $c \
    --variants off lookup --server-flags "--speculate-max-batch 32" --json $OUT/spec_c$c.json
done
