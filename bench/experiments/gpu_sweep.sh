#!/usr/bin/env bash
# Server flags (or code) against throughput on a GPU host: for each set, our server under a closed
# loop at one concurrency, logprobs off and top 20 alternating (3 runs each, 128 new tokens). A set
# may hold environment settings ("OMLX_SWITCH_INTERVAL=0.001 --prefill-chunk 512"), and may start
# with @DIR to run the package copy in DIR (an older commit's, from `git archive HEAD~1 omlx_logprobs`).
# Usage: bash bench/experiments/gpu_sweep.sh MODEL_DIR CONCURRENCY "FLAGS A" "@old FLAGS A" ...
# LOADGEN_FLAGS adds load generator flags (LOADGEN_FLAGS="--processes 8"); the server's log goes
# to $OUT/sweep.log (OUT default $TMPDIR/omlx-bench).
set -u
model=$1; c=$2; shift 2
log=${OUT:-${TMPDIR:-/tmp}/omlx-bench}/sweep.log; mkdir -p $(dirname $log)
load() {  # logprobs seed
  python3 -m bench.loadgen --base-url http://127.0.0.1:8108/v1 --model "$(basename $model)" \
    --concurrency $c --requests $(( c * 3 )) --max-tokens 128 --logprobs $1 --prompt-words 32 \
    --seed $2 ${LOADGEN_FLAGS:-} 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1), 'e', d['errors'])"
}
for flags in "$@"; do
  envs=""; args=""; path=$PWD
  for t in $flags; do
    if [[ $t == @* ]]; then path=$PWD/${t:1}
    elif [[ $t =~ ^[A-Z_]+= ]]; then envs="$envs $t"
    else args="$args $t"; fi
  done
  (cd $path && env $envs PYTHONPATH=$path:$PYTHONPATH python3 -m omlx_logprobs.cli serve --model $model --port 8108 --max-num-seqs 64 --log-level info $args) > $log 2>&1 &
  pid=$!
  for _ in $(seq 180); do curl -sf http://127.0.0.1:8108/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
  load 20 99 >/dev/null; load off 98 >/dev/null
  line="[$flags]"
  for r in 1 2 3; do line="$line | off $(load off $r) top20 $(load 20 $r)"; done
  echo "$line"
  grep "engine:" $log | tail -1 | cut -c1-220
  kill $pid; wait $pid 2>/dev/null
done
