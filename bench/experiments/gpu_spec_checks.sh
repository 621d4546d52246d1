#!/usr/bin/env bash
# After gpu_speculation.sh's model builds (or building them): where greedy answers with and
# without speculation part in bfloat16 (spec_divergence.py: chat and repeat), a useless draft
# model under the measured off rule (speculation.py, draft B, off against draft), and c=32
# throughput without speculation with cuDNN's attention off and on (the server's default).
# Set-up and paths: gpu_env.sh; writes $OUT/spec_*.json.
set -eu
source bench/experiments/gpu_env.sh
model_r8q; model_r1q
for p in chat repeat; do
  python3 -m bench.experiments.spec_divergence --model $R8Q --prompt $p
done
python3 -m bench.speculation --model $R8Q --draft-model $R1Q --max-tokens 256 \
  --no-mlx-lm --variants off draft --json $OUT/spec_small_draft.json
MLX_CUDA_USE_CUDNN_SDPA=0 python3 -m bench.speculation --model $R8Q --max-tokens 128 \
  --no-mlx-lm --variants off --json $OUT/spec_off_nocudnn.json
