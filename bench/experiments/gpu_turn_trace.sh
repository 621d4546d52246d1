#!/usr/bin/env bash
# Where a long conversation's turn spends its time on the GPU host: bench/conversation.py with
# ours alone, the engine's per-step trace on (OMLX_STEP_TRACE=1: launch / complete ms, rows,
# prefill tokens) and the bench's request times on the same clock ("request-trace:" lines), and
# bare mlx-lm's new-over-context prefill after. Writes $OUT/on.log, $OUT/conversation.json.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_CACHE_MAXSIZE=4294967296 OMLX_STEP_TRACE=1
[ -f /tmp/r8q/config.json ] || {
  python3 bench/randmodel.py --out /tmp/r8 --tokenizer-from .gpu/tok --size 8b --context 32768
  python3 -m mlx_lm convert --hf-path /tmp/r8 --mlx-path /tmp/r8q -q --q-bits 4
  rm -rf /tmp/r8
}
python3 bench/conversation.py --model /tmp/r8q --turns ${TURNS:-8} --tool-words ${WORDS:-800} \
  --only-ours --json $OUT/conversation.json --logs $OUT
