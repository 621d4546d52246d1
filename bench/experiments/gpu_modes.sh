#!/usr/bin/env bash
# The engine's own accounting per logprobs mode: one server, long closed-loop runs (10 waves, so
# each mode fills whole 10 s stats windows), the engine's stats line after each run.
# Usage: bash bench/experiments/gpu_modes.sh MODEL_DIR CONCURRENCY "off 20 off 20" [SERVER FLAGS...]
# LOADGEN_FLAGS adds load generator flags (LOADGEN_FLAGS=--stream). Pass "--processes 16" to
# measure as the GPU preset does: one client process parsing every top-20 body paces the loop
# (c=32 on an H100: top20/off 0.86 with one client process, 0.945 with 16).
set -u
model=$1; c=$2; modes=$3; shift 3
OMLX_STATS_INTERVAL_S=${OMLX_STATS_INTERVAL_S:-3} python3 -m omlx_logprobs.cli serve --model $model --port 8107 --max-num-seqs 64 --log-level info "$@" > /tmp/modes.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8107/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
cpu() {  # CPU seconds of one process
  awk '{print ($14 + $15) / 100}' /proc/$1/stat 2>/dev/null || echo 0
}
child=$(for f in $(grep -l "^PPid:[[:space:]]*$pid\$" /proc/[0-9]*/status 2>/dev/null); do
  d=${f%/status}; tr '\0' ' ' < $d/cmdline | grep -q spawn_main && echo ${d#/proc/}; done | head -1)  # the engine
load() {  # logprobs requests
  python3 bench/loadgen.py --base-url http://127.0.0.1:8107/v1 --model "$(basename $model)" \
    --concurrency $c --requests $2 --max-tokens 128 --logprobs $1 --prompt-words 32 --seed $RANDOM ${LOADGEN_FLAGS:-} \
    2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1), 'tok/s, errors', d['errors'])"
}
load 20 $(( c * 2 )) >/dev/null; load off $(( c * 2 )) >/dev/null
for lp in $modes; do
  n=$(grep -c "engine:" /tmp/modes.log)
  p0=$(cpu $pid); c0=$(cpu $child); t0=$(date +%s.%N)
  r=$( { TIMEFORMAT='%U %S'; time load $lp $(( c * 10 )); } 2>/tmp/loadgen.time )
  p1=$(cpu $pid); c1=$(cpu $child); t1=$(date +%s.%N)
  echo "lp=$lp $r; cores used: $(python3 -c "import sys; a = [float(x) for x in sys.argv[1:]]; w = a[7] - a[6]; print(f'server {(a[1] - a[0]) / w:.2f}, engine {(a[3] - a[2]) / w:.2f}, loadgen {(a[4] + a[5]) / w:.2f}')" $p0 $p1 $c0 $c1 $(tail -1 /tmp/loadgen.time) $t0 $t1)"
  grep "engine:" /tmp/modes.log | tail -n +$(( n + 1 )) | sed 's/.*engine: /    /'
  curl -s http://127.0.0.1:8107/health | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print(f\"    MLX active {e['active_memory']/2**30:.1f} GiB, cache {e['cache_memory']/2**30:.1f} GiB\")"
done
kill $pid; wait $pid 2>/dev/null
