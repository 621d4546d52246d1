#!/usr/bin/env bash
# Quick GPU sanity: the engine in a closed loop, then one request through the real server.
set -u
model=$1
timeout 120 python3 bench/engine_bench.py --model $model --batch 8 --max-tokens 32 --rounds 1 --closed-loop 2 --modes off top20 2>&1 | tail -4
python3 -m omlx_logprobs.cli serve --model $model --port 8105 --log-level info > /tmp/s.log 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8105/health >/dev/null && break; kill -0 $pid || break; sleep 1; done
timeout 60 curl -s http://127.0.0.1:8105/v1/chat/completions -H 'content-type: application/json' \
  -d "{\"model\":\"$(basename $model)\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":8,\"logprobs\":true,\"top_logprobs\":2}" | head -c 300; echo
timeout 120 python3 bench/loadgen.py --base-url http://127.0.0.1:8105/v1 --model "$(basename $model)" --concurrency 8 --requests 16 --max-tokens 32 --logprobs 5 2>/dev/null | head -c 400; echo
kill $pid; wait; grep -E "ERROR|Traceback|engine:" /tmp/s.log | head -10
