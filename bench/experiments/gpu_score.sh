#!/usr/bin/env bash
# Scoring on a GPU host: the pieces (score_micro.py), then our server under a scoring load with
# cProfile on both threads. Usage: bash bench/experiments/gpu_score.sh MODEL_DIR [CONCURRENCY REQUESTS WORDS]
set -u
model=$1; c=${2:-8}; n=${3:-64}; words=${4:-400}
python3 bench/experiments/score_micro.py $model 512
python3 bench/experiments/profile_server.py serve --model $model --port 8107 --max-num-seqs 64 --log-level info ${SERVE_FLAGS:-} > /tmp/score.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8107/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
timeout 200 python3 bench/experiments/score_load.py http://127.0.0.1:8107/v1 "$(basename $model)" $c $n $words
kill -INT $pid; wait $pid
grep -E "engine:" /tmp/score.log | tail -4
sed -n '/===== /,$p' /tmp/score.log | grep -v "^$" | cut -c1-160 | head -${PROFILE_LINES:-60}
