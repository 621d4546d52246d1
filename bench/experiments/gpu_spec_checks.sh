#!/usr/bin/env bash
# After gpu_speculation.sh's model builds (or building them): where greedy answers with and
# without speculation part in bfloat16 (spec_divergence.py: chat and repeat), a useless draft
# model under the measured off rule (speculation.py, draft B, off against draft), and c=32
# throughput without speculation with cuDNN's attention off and on (the server's default).
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH CUDA_CACHE_MAXSIZE=4294967296
for size in 8b 1b; do
  q=/tmp/r${size%b}q
  [ -f $q/config.json ] || {
    python3 bench/randmodel.py --out /tmp/rr --tokenizer-from .gpu/tok --size $size --context 32768
    python3 -m mlx_lm convert --hf-path /tmp/rr --mlx-path $q -q --q-bits 4
    rm -rf /tmp/rr
  }
done
for p in chat repeat; do
  python3 bench/experiments/spec_divergence.py --model /tmp/r8q --prompt $p
done
python3 bench/speculation.py --model /tmp/r8q --draft-model /tmp/r1q --max-tokens 256 \
  --no-mlx-lm --variants off draft --json $OUT/spec_small_draft.json
MLX_CUDA_USE_CUDNN_SDPA=0 python3 bench/speculation.py --model /tmp/r8q --max-tokens 128 \
  --no-mlx-lm --variants off --json $OUT/spec_off_nocudnn.json
