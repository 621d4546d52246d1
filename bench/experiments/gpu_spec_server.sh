#!/usr/bin/env bash
# Where our server's speculating steps differ from the same engine in-process (spec_engine.py):
# the agreeing pair (gpu_agreeing_pair.sh), free chat through the server with the engine in a
# process of its own and in a thread of the server's, each step traced (OMLX_STEP_TRACE=1) and
# the last request's steps summarized (trace_summary.py).
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} CUDA_CACHE_MAXSIZE=4294967296
[ -f /tmp/t8/config.json ] || python3 bench/agreeing_pair.py --tokenizer-from .gpu/tok \
  --size 8b --layer-scale ${SCALE:-0.0025} --target /tmp/t8 --draft /tmp/d8
for engine in process thread; do
  rm -f /tmp/bench-server-*.log
  OMLX_STEP_TRACE=1 python3 bench/speculation.py --model /tmp/t8 --draft-model /tmp/d8 \
    --max-tokens ${TOKENS:-256} --tasks chat --concurrency 0 --variants off draft --no-mlx-lm \
    --server-flags "--engine $engine" 2>&1 | grep -E "tok/s|rror"
  python3 bench/experiments/trace_summary.py /tmp/bench-server-*.log
done
