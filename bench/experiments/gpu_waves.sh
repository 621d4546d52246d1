#!/usr/bin/env bash
# Where a closed-loop run's time goes on a GPU host (bench/waves.py): one server with the step
# trace on, runs of WAVES waves in the given logprobs modes, each run's request records beside
# the server's log in OUT_DIR. Usage: bash bench/experiments/gpu_waves.sh MODEL_DIR CONCURRENCY WAVES "off 20 off 20"
# OUT_DIR [SERVER FLAGS...]; LOADGEN_FLAGS adds load generator flags ("--processes 8").
# PIN=1 runs the server and the load generator on disjoint halves of the physical cores.
# TREE=DIR serves the omlx_logprobs/ of another tree (an older build, from `git archive`).
set -u
model=$1; c=$2; waves=$3; modes=$4; out=$5; shift 5
mkdir -p $out; rm -f $out/run*.jsonl
server_cpus=""; client_cpus=""
if [ -n "${PIN:-}" ]; then
  read server_cpus client_cpus < <(python3 -m bench.cpu_halves)
  echo "server on CPUs $server_cpus, load generator on $client_cpus"
fi
model=$(realpath $model); out=$(realpath $out)
(cd ${TREE:-.} && OMLX_STEP_TRACE=1 exec ${server_cpus:+taskset -c $server_cpus} python3 -m omlx_logprobs.cli serve \
  --model $model --port 8109 --max-num-seqs 64 --log-level info "$@") > $out/server.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8109/health >/dev/null && break; kill -0 $pid || exit 1; sleep 1; done
load() {  # logprobs requests [records file]
  ${client_cpus:+taskset -c $client_cpus} python3 -m bench.loadgen --base-url http://127.0.0.1:8109/v1 --model "$(basename $model)" \
    --concurrency $c --requests $2 --max-tokens 128 --logprobs $1 --prompt-words 32 \
    --seed $RANDOM ${LOADGEN_FLAGS:-} ${3:+--records $3} 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1), 'tok/s, errors', d['errors'])"
}
for lp in off 0 5 20; do load $lp 1 >/dev/null; done  # every mode's full-length request
load 20 $c >/dev/null; load off $c >/dev/null
i=0
for lp in $modes; do
  i=$((i + 1)); echo "run $i lp=$lp $(load $lp $(( c * waves )) $out/run$(printf %02d $i)_$lp.jsonl)"
done
sleep 1; kill $pid; wait $pid 2>/dev/null
python3 -m bench.waves --concurrency $c $out/server.log $out/run*.jsonl
