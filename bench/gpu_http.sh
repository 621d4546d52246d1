#!/usr/bin/env bash
# Ad-hoc HTTP comparison on a GPU host (until bench/run.py has a gpu preset): our server and
# mlx-lm's on the same random model, closed loop, 128 tokens, logprobs off / top 5 / top 20.
# Usage: bash bench/gpu_http.sh MODEL_DIR "8 32 64"
set -u
model=$1; concs=${2:-"8 32 64"}; out=${OUT:-/tmp}
load() {  # port conc logprobs [model name]
  python3 bench/loadgen.py --base-url http://127.0.0.1:$1/v1 --model "${4:-$(basename $model)}" \
    --concurrency $2 --requests $(( $2 * 3 )) --max-tokens 128 --logprobs $3 --prompt-words 32 \
    --seed $RANDOM 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_s'],1), 'tok/s errors', d['errors'], (d.get('error_samples') or [''])[0][:150])"
}
wait_up() { for _ in $(seq 180); do curl -sf http://127.0.0.1:$1/$2 >/dev/null && return 0; kill -0 $3 2>/dev/null || return 1; sleep 1; done; return 1; }
python3 -m omlx_logprobs.cli serve --model $model --port 8101 --max-num-seqs 64 --log-level info > $out/omlx.log 2>&1 &
wait_up 8101 health $! || { tail $out/omlx.log; exit 1; }
for c in $concs; do load 8101 $c 20 >/dev/null; for lp in off 20 5 off 20; do echo "omlx c=$c lp=$lp $(load 8101 $c $lp)"; done; done
kill %1; wait; grep "engine:" $out/omlx.log | tail -8
[ -n "${SKIP_MLXLM:-}" ] && exit 0
python3 -m mlx_lm.server --model $model --port 8102 > $out/mlxlm.log 2>&1 &
wait_up 8102 v1/models $! || { tail $out/mlxlm.log; exit 1; }
for c in $concs; do load 8102 $c 5 $model >/dev/null; for lp in off 5; do echo "mlx-lm c=$c lp=$lp $(load 8102 $c $lp $model)"; done; done
kill %1; wait
