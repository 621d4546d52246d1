#!/usr/bin/env bash
# Profile our server's two threads under a closed-loop load (see bench/experiments/profile_server.py).
# Usage: bash bench/experiments/gpu_profile.sh MODEL_DIR CONCURRENCY LOGPROBS
set -u
model=$1; c=${2:-64}; lp=${3:-20}
python3 bench/experiments/profile_server.py serve --model $model --port 8103 --max-num-seqs 64 --log-level info > /tmp/prof.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8103/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
for r in 1; do
  timeout 150 python3 bench/loadgen.py --base-url http://127.0.0.1:8103/v1 --model "$(basename $model)" --concurrency $c \
    --requests $(( c * 3 )) --max-tokens 128 --logprobs $lp --seed $r 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin); print('tok/s', round(d['tokens_per_s'],1), 'errors', d['errors'])"
done
kill -INT $pid; wait $pid
grep -E "engine:" /tmp/prof.log | tail -3
sed -n '/===== /,$p' /tmp/prof.log | grep -v "^$" | cut -c1-150
