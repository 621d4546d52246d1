#!/usr/bin/env bash
# One process against two on a host with two GPUs: a random llama with Llama-3-8B's shapes in
# bfloat16 (python -m bench.randmodel --size 8b, 15 GB), served by one process on GPU 0, then split
# tensor parallel over both GPUs (mlx.launch, MLX's NCCL backend; docs/distributed.md). For each,
# bench/loadgen.py in a closed loop at concurrency 1 and 16 (128 new tokens, top-5 logprobs),
# and one request's logprobs side by side. About 5 minutes with the model built.
# Usage: bash bench/experiments/gpu_distributed.sh TOKENIZER_DIR [MODEL_DIR]
# (TOKENIZER_DIR: SmolLM2's tokenizer files, as OMLX_TEST_TOKENIZER_DIR; the model is built there
# once, in MODEL_DIR, default $MODELS/rand-8b, MODELS as in gpu_env.sh; logs in $OUT, default
# $TMPDIR/omlx-bench.)
# SIZE=tiny BACKEND=ring PY=.venv/bin/python try it on a CPU.
set -u
py=${PY:-python3}
size=${SIZE:-8b}
backend=${BACKEND:-nccl}
tok=$1
model=${2:-${MODELS:-$HOME/.cache/omlx-bench}/rand-8b}
out=${OUT:-${TMPDIR:-/tmp}/omlx-bench}; mkdir -p $out
port=8109
name=$(basename $model)
launch=($py -c "from mlx._distributed_utils.launch import main; main()")

$py -c "import mlx.core as mx; print('MLX', mx.__version__, mx.default_device(), 'nccl:', mx.distributed.is_available())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
t0=$(date +%s)
timeout 300 $py -m bench.randmodel --out $model --tokenizer-from $tok --size $size || exit 1
echo "model ready in $(( $(date +%s) - t0 )) s"

load() {  # concurrency requests
  timeout 150 $py -m bench.loadgen --base-url http://127.0.0.1:$port/v1 --model $name \
    --concurrency $1 --requests $2 --max-tokens 128 --logprobs 5 --prompt-words 64 --seed 7 \
    2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"{d['tokens_per_s']:.1f} tokens/s, errors {d['errors']}\")"
}
one_request() {
  timeout 60 curl -s http://127.0.0.1:$port/v1/completions -H 'content-type: application/json' \
    -d "{\"model\":\"$name\",\"prompt\":\"The quick brown fox\",\"max_tokens\":6,\"temperature\":0,\"logprobs\":1}" \
    | python3 -c "import json,sys; c=json.load(sys.stdin)['choices'][0]['logprobs']; print(c['tokens'], [round(x, 4) for x in c['token_logprobs']])"
}
rank0() {  # the serving process without MLX_RANK, or with MLX_RANK=0
  for p in $(pgrep -f "^$py -m omlx_logprobs.cli serve --model $model"); do
    r=$(tr '\0' '\n' < /proc/$p/environ | sed -n 's/^MLX_RANK=//p')
    [ -z "$r" ] || [ "$r" = 0 ] && echo $p
  done | head -1
}
run() {  # label, then the command that serves
  local label=$1; shift
  "$@" > $out/dist-$label.log 2>&1 &
  local pid=$!
  local t=$(date +%s)
  for _ in $(seq 240); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  echo "== $label: up in $(( $(date +%s) - t )) s"
  curl -s http://127.0.0.1:$port/health | python3 -c "import json,sys; d=json.load(sys.stdin)['engine'].get('distributed'); print('group:', d and [(r['rank'], r['holds'], r['weight_mib']) for r in d['ranks']])"
  one_request
  load 2 4 >/dev/null  # warm-up: first shapes
  echo "c=1:  $(load 1 6)"
  echo "c=16: $(load 16 48)"
  grep "engine:" $out/dist-$label.log | tail -1 | cut -c1-240
  grep -E "ERROR|Traceback" $out/dist-$label.log | head -5
  # SIGTERM to the server, rank 0 (it stops the other rank itself); not to mlx.launch
  kill $(rank0) 2>/dev/null
  for _ in $(seq 40); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
}

serve=(-m omlx_logprobs.cli serve --model $model --port $port --max-num-seqs 32 --log-level info)
run one env CUDA_VISIBLE_DEVICES=0 $py "${serve[@]}"
run two "${launch[@]}" -n 2 --backend $backend --python $py -- "${serve[@]}"
grep -E "rank [01] on|distributed:" $out/dist-two.log | head -4
echo "total $(( $(date +%s) - t0 )) s"
