#!/usr/bin/env bash
# feature_cost.py on the GPU host's random 1.1B, each variant a fresh process, alternating
# (VARIANTS, FC_ARGS); needs MLX, .whl/ and .gpu/tok/ as gpu_one_stream.sh. OUT=... bash THIS
set -u
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
[ -f /root/m1b/config.json ] || python3 bench/randmodel.py --out /root/m1b --tokenizer-from .gpu/tok --size 1b > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
for v in ${VARIANTS:-default no-prefix-cache default no-prefix-cache no-keep no-speculate}; do
  timeout 200 python3 bench/experiments/feature_cost.py --model /root/m1b --variant $v ${FC_ARGS:-} > $OUT/fc_$v.log 2>&1
  grep "^\[" $OUT/fc_$v.log; grep -E "warm failed|Error|Traceback" -A3 $OUT/fc_$v.log | head -30
done
