#!/usr/bin/env bash
# bench/experiments/turn_phases.py on the GPU host: a random llama in Llama-3-8B's shape, 4-bit,
# 8 turns growing by 2,900 tokens to ~23k; the server's defaults, bare mlx-lm on MLX's own
# attention. Needs MLX (../shared/gpu/README.md) and SmolLM2's tokenizer files in .gpu/tok/;
# writes $OUT/phases.json.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} CUDA_CACHE_MAXSIZE=4294967296
[ -f /tmp/r8q/config.json ] || {
  python3 bench/randmodel.py --out /tmp/r8 --tokenizer-from .gpu/tok --size 8b --context 32768
  python3 -m mlx_lm convert --hf-path /tmp/r8 --mlx-path /tmp/r8q -q --q-bits 4
  rm -rf /tmp/r8
}
python3 bench/experiments/turn_phases.py --model /tmp/r8q --turns ${TURNS:-8} --mlx-attention \
  --json $OUT/phases.json 2>&1 | grep -E "cuDNN|^turn|^bare|rror" | tail -40
