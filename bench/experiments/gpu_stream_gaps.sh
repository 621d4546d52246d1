#!/usr/bin/env bash
# The agreeing pair (gpu_agreeing_pair.sh) served with its draft model, the steps traced: when
# the chat request's chunks reach the client against when the engine's steps end
# (stream_gaps.py), for each engine placement in $ENGINES (default "process thread"), with the
# start-up warm's log line and each server's log under $OUT.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} CUDA_CACHE_MAXSIZE=4294967296
[ -f /tmp/t8/config.json ] || python3 bench/agreeing_pair.py --tokenizer-from .gpu/tok \
  --size 8b --layer-scale ${SCALE:-0.0025} --target /tmp/t8 --draft /tmp/d8 >/dev/null
for engine in ${ENGINES:-process thread}; do
  echo "== engine in a $engine"
  OMLX_STEP_TRACE=1 python3 -m omlx_logprobs.cli serve --host 127.0.0.1 --port 8195 --model /tmp/t8 \
    --draft-model /tmp/d8 --num-draft-tokens 8 --max-logprobs 100 --engine $engine \
    > /tmp/gaps-$engine.log 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8195/health >/dev/null && break; sleep 1; done
  grep -h "warmed in\|draft model:" /tmp/gaps-$engine.log || true
  python3 bench/experiments/stream_gaps.py --base http://127.0.0.1:8195/v1 \
    --log /tmp/gaps-$engine.log --max-tokens ${TOKENS:-256} | grep -v "chunk gaps"
  kill $pid; wait $pid 2>/dev/null || true
  [ -z "${OUT:-}" ] || cp /tmp/gaps-$engine.log $OUT/
done
