#!/usr/bin/env bash
# Two builds of the server side by side on one machine (the CPU box or a GPU host): rounds
# alternate the build and the logprobs mode (off, top 20), so that the machine's speed phases
# fall on every side alike. Prints one line per round: each build's tok/s in each mode.
# Usage, from the repo root (the new build is this tree):
#   bash bench/ab.sh MODEL_DIR|embedded OLD_TREE "CONCURRENCIES" ROUNDS [SERVER FLAGS...]
# OLD_TREE holds an older omlx_logprobs/ (`mkdir -p /tmp/old && git archive REV omlx_logprobs |
# tar -x -C /tmp/old`); `embedded` is the embedded SmolLM2-135M-Instruct.
# Knobs (defaults: the gpu preset's load; on the 2-core CPU box use the cpu preset's, e.g.
# PY=.venv/bin/python MAX_TOKENS=32 PROMPT_WORDS=16 PROCESSES=1 WAVES=1):
#   PY (python3), WAVES (2: requests a run, in waves of the concurrency), MAX_TOKENS (128),
#   PROMPT_WORDS (32), PROCESSES (16: load generator processes).
set -u
py=${PY:-python3}
if [ "$1" = embedded ]; then
  model=$($py -c "import omlx_logprobs.models.loader as l; print(l.resolve_model_path(None)[0])")
else
  model=$(realpath $1)
fi
old=$(realpath $2); cs=$3; rounds=$4; shift 4
start() {  # tree port [flags]: `-m` imports from the working directory first
  local tree=$1 port=$2; shift 2
  (cd $tree && exec $py -m omlx_logprobs.cli serve --model $model --port $port \
    --max-num-seqs 64 "$@") > /tmp/ab_$port.log 2>&1 &
}
start "$old" 8201 "$@"; start "$PWD" 8202 "$@"
for p in 8201 8202; do
  for _ in $(seq 240); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 1; done
  if ! curl -sf http://127.0.0.1:$p/health >/dev/null; then  # no server: no rounds to run
    echo "the server on port $p did not start:"; tail -n 20 /tmp/ab_$p.log; kill %1 %2 2>/dev/null
    exit 1
  fi
done
load() {  # port mode requests -> tok/s
  $py -m bench.loadgen --base-url http://127.0.0.1:$1/v1 --model "$(basename $model)" \
    --concurrency $c --requests $3 --max-tokens ${MAX_TOKENS:-128} --logprobs $2 \
    --prompt-words ${PROMPT_WORDS:-32} --seed $RANDOM --processes ${PROCESSES:-16} 2>/dev/null \
    | $py -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1) if not d['errors'] else 'ERR')"
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
