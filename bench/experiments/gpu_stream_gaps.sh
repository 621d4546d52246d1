#!/usr/bin/env bash
# The agreeing pair (gpu_agreeing_pair.sh) served with its draft model, the steps traced: when
# the chat request's chunks reach the client against when the engine's steps end
# (stream_gaps.py), for each engine placement in $ENGINES (default "process thread"), with the
# start-up warm's log line and each server's log under $OUT. Set-up and paths: gpu_env.sh.
set -eu
source bench/experiments/gpu_env.sh
[ -f $T8/config.json ] || agreeing_pair >/dev/null
for engine in ${ENGINES:-process thread}; do
  echo "== engine in a $engine"
  log=$OUT/gaps-$engine.log
  OMLX_STEP_TRACE=1 python3 -m omlx_logprobs.cli serve --host 127.0.0.1 --port 8195 --model $T8 \
    --draft-model $D8 --num-draft-tokens 8 --max-logprobs 100 --engine $engine > $log 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8195/health >/dev/null && break; sleep 1; done
  grep -h "warmed in\|draft model:" $log || true
  python3 -m bench.experiments.stream_gaps --base http://127.0.0.1:8195/v1 \
    --log $log --max-tokens ${TOKENS:-256} | grep -v "chunk gaps"
  kill $pid; wait $pid 2>/dev/null || true
done
