#!/usr/bin/env bash
# The agreeing pair (gpu_agreeing_pair.sh) served with its draft model, the steps traced: when
# the chat request's chunks reach the client against when the engine's steps end
# (stream_gaps.py). Engine: $ENGINE (process, the default, or thread).
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} CUDA_CACHE_MAXSIZE=4294967296
[ -f /tmp/t8/config.json ] || python3 bench/experiments/agreeing_pair.py --tokenizer-from .gpu/tok \
  --size 8b --layer-scale ${SCALE:-0.0025} --target /tmp/t8 --draft /tmp/d8 >/dev/null
OMLX_STEP_TRACE=1 python3 -m omlx_logprobs.cli serve --host 127.0.0.1 --port 8195 --model /tmp/t8 \
  --draft-model /tmp/d8 --num-draft-tokens 8 --max-logprobs 100 --engine ${ENGINE:-process} \
  > /tmp/gaps.log 2>&1 &
for _ in $(seq 300); do curl -sf http://127.0.0.1:8195/health >/dev/null && break; sleep 1; done
python3 bench/experiments/stream_gaps.py --base http://127.0.0.1:8195/v1 --log /tmp/gaps.log \
  --max-tokens ${TOKENS:-256}
kill %1
