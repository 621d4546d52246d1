#!/usr/bin/env bash
# The multi-turn agent trace on the GPU host (bench/conversation.py): a random llama in
# Llama-3-8B's shape, 4-bit, 32k context; 8 turns growing to ~24k tokens; ours with the prefix
# cache, ours without, mlx-lm's server. Needs MLX (../shared/gpu/README.md), the web wheels in
# .whl/ and SmolLM2's tokenizer files in .gpu/tok/; writes $OUT/conversation.json.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
[ -f /tmp/r8q/config.json ] || {
  python3 bench/randmodel.py --out /tmp/r8 --tokenizer-from .gpu/tok --size 8b --context 32768
  python3 -m mlx_lm convert --hf-path /tmp/r8 --mlx-path /tmp/r8q -q --q-bits 4
  rm -rf /tmp/r8
}
python3 bench/conversation.py --model /tmp/r8q --turns ${TURNS:-8} --tool-words ${WORDS:-800} \
  --json $OUT/conversation.json --logs $OUT
