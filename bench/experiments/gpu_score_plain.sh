#!/usr/bin/env bash
# Prompt scoring against plain prefill on our server (no profiler), on a GPU host.
# Usage: bash bench/experiments/gpu_score_plain.sh MODEL_DIR [CONCURRENCY REQUESTS WORDS] [SERVER FLAGS...]
set -u
model=$1; c=${2:-8}; n=${3:-64}; words=${4:-400}; shift 4 || shift $#
python3 -m omlx_logprobs.cli serve --model $model --port 8109 --max-num-seqs 64 --log-level info "$@" > /tmp/score_plain.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8109/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
timeout 200 python3 bench/experiments/score_load.py http://127.0.0.1:8109/v1 "$(basename $model)" $c $n $words
kill $pid; wait $pid 2>/dev/null
grep -E "engine:" /tmp/score_plain.log | tail -2 | cut -c1-200
