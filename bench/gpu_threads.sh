#!/usr/bin/env bash
# Per-thread CPU use of our server under a closed-loop load (which thread is the bottleneck).
set -u
model=$1; c=${2:-64}; lp=${3:-20}
python3 -m omlx_logprobs.cli serve --model $model --port 8106 --max-num-seqs 64 --log-level warning > /tmp/t.log 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8106/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
timeout 100 python3 bench/loadgen.py --base-url http://127.0.0.1:8106/v1 --model "$(basename $model)" --concurrency $c \
  --requests $(( c * 6 )) --max-tokens 128 --logprobs $lp 2>/dev/null > /tmp/load.json &
sleep 6
snap() { for t in /proc/$pid/task/*; do echo "$(basename $t) $(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done; }
snap > /tmp/a; sleep 5; snap > /tmp/b
join /tmp/a /tmp/b | awk '{d=($5-$3)/5; if (d>0) print $1, $2, d "% of a core"}'
ps -o pid,pcpu,comm -p $(pgrep -f loadgen.py | head -1)
wait %2; python3 -c "import json; d=json.load(open('/tmp/load.json')); print('tok/s', round(d['tokens_per_s'],1), 'errors', d['errors'])"
kill $pid; wait
