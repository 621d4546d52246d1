#!/usr/bin/env bash
# The engine's own accounting per logprobs mode: one server, long closed-loop runs (10 waves, so
# each mode fills whole 10 s stats windows), the engine's stats line after each run.
# Usage: bash bench/gpu_modes.sh MODEL_DIR CONCURRENCY "off 20 off 20" [SERVER FLAGS...]
set -u
model=$1; c=$2; modes=$3; shift 3
python3 -m omlx_logprobs.cli serve --model $model --port 8107 --max-num-seqs 64 --log-level info "$@" > /tmp/modes.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8107/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
load() {  # logprobs requests
  python3 bench/loadgen.py --base-url http://127.0.0.1:8107/v1 --model "$(basename $model)" \
    --concurrency $c --requests $2 --max-tokens 128 --logprobs $1 --prompt-words 32 --seed $RANDOM \
    2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1), 'tok/s, errors', d['errors'])"
}
load 20 $(( c * 2 )) >/dev/null; load off $(( c * 2 )) >/dev/null
for lp in $modes; do
  n=$(grep -c "engine:" /tmp/modes.log)
  echo "lp=$lp $(load $lp $(( c * 10 )))"
  grep "engine:" /tmp/modes.log | tail -n +$(( n + 1 )) | sed 's/.*engine: /    /'
done
kill $pid; wait $pid 2>/dev/null
