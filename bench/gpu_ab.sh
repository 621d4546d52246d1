#!/usr/bin/env bash
# Two builds of the server side by side on one GPU host: rounds alternate the build and the
# logprobs mode (off, top 20), so that the host's speed phases fall on every side alike.
# Usage: bash bench/gpu_ab.sh MODEL_DIR OLD_TREE "CONCURRENCIES" ROUNDS [SERVER FLAGS...]
# OLD_TREE holds an older omlx_logprobs/ (e.g. `git archive REV omlx_logprobs | tar -x -C DIR`).
# WAVES (default 2): requests a run, in waves of the concurrency.
set -u
model=$(realpath $1); old=$(realpath $2); cs=$3; rounds=$4; shift 4
start() {  # tree port [flags]: `-m` imports from the working directory first
  local tree=$1 port=$2; shift 2
  (cd $tree && exec python3 -m omlx_logprobs.cli serve --model $model --port $port \
    --max-num-seqs 64 "$@") > /tmp/ab_$port.log 2>&1 &
}
start "$old" 8201 "$@"; start "$PWD" 8202 "$@"
for p in 8201 8202; do
  for _ in $(seq 240); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 1; done
done
load() {  # port mode requests -> tok/s
  python3 bench/loadgen.py --base-url http://127.0.0.1:$1/v1 --model "$(basename $model)" \
    --concurrency $c --requests $3 --max-tokens 128 --logprobs $2 --prompt-words 32 \
    --seed $RANDOM --processes 16 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1) if not d['errors'] else 'ERR')"
}
for c in $cs; do
for p in 8201 8202; do load $p 20 $(( c * 2 )) >/dev/null; load $p off $(( c * 2 )) >/dev/null; done
for r in $(seq $rounds); do
  line="round $r c=$c"
  ports="8201 8202"; [ $(( r % 2 )) = 0 ] && ports="8202 8201"
  for p in $ports; do
    modes="off 20"; [ $(( (r / 2) % 2 )) = 1 ] && modes="20 off"
    for m in $modes; do line="$line | $([ $p = 8201 ] && echo old || echo new) $m $(load $p $m $(( c * ${WAVES:-2} )))"; done
  done
  echo "$line"
done
done
kill %1 %2 2>/dev/null; wait 2>/dev/null
grep -hE "Traceback|ERROR" /tmp/ab_8201.log /tmp/ab_8202.log | head -5
