#!/usr/bin/env bash
# Top 100 against off, top 20 and top 100 in base64 on the CPU box: the embedded model, c=8, 32
# requests of 32 tokens, two rounds (completion tok/s). PY: the Python (default .venv/bin/python).
set -u
PY=${PY:-.venv/bin/python}
$PY -m omlx_logprobs.cli serve --port 8731 --max-logprobs 100 --log-level warning > "${TMPDIR:-/tmp}/top100-server.log" 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8731/health >/dev/null && break; sleep 1; done
run() { $PY -m bench.loadgen --base-url http://127.0.0.1:8731/v1 --model SmolLM2-135M-Instruct --concurrency 8 --requests 32 --max-tokens 32 --prompt-words 16 --temperature 0 "$@" 2>/dev/null | grep -E "^  \"tokens_per_s\"" | head -1; }
run --logprobs off >/dev/null  # warm-up
for round in 1 2; do
  for mode in "off" "20" "100" "100 base64"; do
    set -- $mode
    if [ "$mode" = "100 base64" ]; then r=$(run --logprobs 100 --logprobs-format base64); else r=$(run --logprobs $1); fi
    echo "round $round top $mode: $r"
  done
done
kill $pid; wait
