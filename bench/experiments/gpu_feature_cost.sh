#!/usr/bin/env bash
# feature_cost.py on the GPU host's random 1.1B ($M1B), each variant a fresh process, alternating
# (VARIANTS, FC_ARGS); set-up and paths: gpu_env.sh. OUT=... bash THIS
set -u
source bench/experiments/gpu_env.sh
model_m1b
nvidia-smi --query-gpu=name --format=csv,noheader
for v in ${VARIANTS:-default no-prefix-cache default no-prefix-cache no-keep no-speculate}; do
  timeout 200 python3 -m bench.experiments.feature_cost --model $M1B --variant $v ${FC_ARGS:-} > $OUT/fc_$v.log 2>&1
  grep "^\[" $OUT/fc_$v.log; grep -E "warm failed|Error|Traceback" -A3 $OUT/fc_$v.log | head -30
done
