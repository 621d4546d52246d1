#!/usr/bin/env bash
# The decode step's host time at 64 rows and tok/s with logprobs off and top 20, for this tree
# and an older one, alternating; about 5-6 minutes on an H100 or H200.
# Usage: TREE=DIR bash bench/experiments/gpu_step.sh MODEL_DIR [ROUNDS] [OUT_DIR]
#   TREE holds the older omlx_logprobs/ (`mkdir -p .gpu/old && git archive REV omlx_logprobs |
#   tar -x -C .gpu/old`); MODEL_DIR: the gpu preset's model (`python -m bench.randmodel --size 1b`).
#   STEPS and MAX_TOKENS (128 each) shorten it for a check of the script on a CPU.
# host_step.py runs as a file, not with -m, so that PYTHONPATH=TREE picks the package it times.
# 1. bench/experiments/host_step.py in-process, 64 rows, 128 steps, off and top 20: the median
#    launch per decode-only step and its graph-building part, for old, new, new with its decode
#    forward compiled (OMLX_COMPILE_DECODE=1) and new with MLX's own attention
#    (OMLX_DECODE_ATTENTION=mlx; runner/fast/attention.py).
# 2. Both servers up, c=64, 128 new tokens: ROUNDS (3) rounds alternating build and mode, with
#    16 client processes (bodies parsed after the clock) and with one process that parses every
#    body in its loop; medians and ratios at the end, and each server's launch per step from its
#    stats lines with 48 rows a step or more.
set -u
model=$(realpath $1); rounds=${2:-3}; out=${3:-${TMPDIR:-/tmp}/gpu_step}
old=$(realpath ${TREE:?TREE: a tree with the older omlx_logprobs/}); new=$PWD
py=${PY:-python3}
mkdir -p $out; rm -f $out/runs.tsv
name=$(basename $model)

echo "== host time per decode step, in-process (64 rows; ms)"
host() {  # label tree [VAR=value | --flag value ...]
  local label=$1 tree=$2 vars=() flags=(); shift 2
  for x in "$@"; do case $x in *=*) vars+=("$x");; *) flags+=("$x");; esac; done
  env "${vars[@]}" PYTHONPATH=$tree:${PYTHONPATH:-} timeout 170 $py $new/bench/experiments/host_step.py --model $model \
    --rows 64 --steps ${STEPS:-128} --top -1 20 --repeat 3 --label "$label " "${flags[@]}" 2>&1 \
    | grep -E "host ms|Error"
}
host old $old
host new $new
host "new, compiled" $new OMLX_COMPILE_DECODE=1
host "new, MLX's attention" $new OMLX_DECODE_ATTENTION=mlx

echo "== servers: c=64, ${MAX_TOKENS:-128} tokens, $rounds rounds a client set-up"
start() {  # tree port
  (cd $1 && OMLX_STATS_INTERVAL_S=2 exec $py -m omlx_logprobs.cli serve --model $model \
    --port $2 --max-num-seqs 64) > $out/server_$2.log 2>&1 &
}
start $old 8301; start $new 8302
trap 'kill %1 %2 2>/dev/null' EXIT
for p in 8301 8302; do
  for _ in $(seq 180); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 1; done
  curl -sf http://127.0.0.1:$p/health >/dev/null || { echo "port $p did not start"; tail -20 $out/server_$p.log; exit 1; }
done
load() {  # port lp requests flags...
  local port=$1 lp=$2 n=$3; shift 3
  timeout 120 $py -m bench.loadgen --base-url http://127.0.0.1:$port/v1 --model $name \
    --concurrency 64 --requests $n --max-tokens ${MAX_TOKENS:-128} --logprobs $lp --prompt-words 32 \
    --seed $RANDOM "$@" 2>/dev/null \
    | $py -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1) if not d['errors'] else 'ERR')"
}
for p in 8301 8302; do load $p 20 64 --processes 16 >/dev/null; load $p off 64 --processes 16 >/dev/null; done
for setup in "16" "1 --parse-in-loop"; do
  flags="--processes $setup"
  for r in $(seq $rounds); do
    line="clients $setup, round $r"
    ports="8301 8302"; [ $(( r % 2 )) = 0 ] && ports="8302 8301"
    for p in $ports; do
      build=$([ $p = 8301 ] && echo old || echo new)
      modes="off 20"; [ $(( (r / 2) % 2 )) = 1 ] && modes="20 off"
      for m in $modes; do
        t=$(load $p $m 128 $flags); t=${t:-ERR}
        line="$line | $build $m $t"
        printf '%s\t%s\t%s\t%s\n' "$setup" $build $m $t >> $out/runs.tsv
      done
    done
    echo "$line"
  done
done
$py - $out <<'EOF'
import re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for line in (out / "runs.tsv").read_text().splitlines():
    setup, build, mode, tps = line.split("\t")
    if tps != "ERR":
        runs.setdefault((setup, build, mode), []).append(float(tps))
med = {k: statistics.median(v) for k, v in runs.items()}
for setup in dict.fromkeys(k[0] for k in med):
    cells = {(b, m): med.get((setup, b, m)) for b in ("old", "new") for m in ("off", "20")}
    def r(a, b):
        return f"{a / b:.2f}" if a and b else "-"
    print(f"clients {setup}: median tok/s old off {cells['old', 'off']}, old top20 "
          f"{cells['old', '20']}, new off {cells['new', 'off']}, new top20 {cells['new', '20']}; "
          f"new/old off {r(cells['new', 'off'], cells['old', 'off'])}, top20 "
          f"{r(cells['new', '20'], cells['old', '20'])}; top20/off old "
          f"{r(cells['old', '20'], cells['old', 'off'])}, new {r(cells['new', '20'], cells['new', 'off'])}")
pat = re.compile(r"([\d.]+) rows/step.*?per step ([\d.]+) ms launch")
for port, build in ((8301, "old"), (8302, "new")):
    text = (out / f"server_{port}.log").read_text(errors="replace")
    full = [float(m[2]) for m in pat.finditer(text) if float(m[1]) >= 48]
    dec = [float(m[1]) for m in re.finditer(r"decode-only steps: \d+, ([\d.]+) ms launch at ([\d.]+) rows", text)
           if float(m[2]) >= 48]
    print(f"{build} server, stats lines with >= 48 rows a step: launch per step median "
          f"{statistics.median(full):.2f} ms over {len(full)} lines" if full else f"{build} server: no such lines",
          f"; decode-only steps {statistics.median(dec):.2f} ms" if dec else "")
EOF
grep -hE "Traceback|ERROR|decode steps not compiled" $out/server_830*.log | head -5
