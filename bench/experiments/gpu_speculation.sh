#!/usr/bin/env bash
# Speculative decoding on the GPU host (bench/speculation.py, bench/experiments/verify_cost.py):
# a random llama in Llama-3-8B's shape, 4-bit, one stream with logprobs (top 20, greedy).
# Random weights follow no task, so:
# - the editing request's prediction is the model's own answer with a character changed every
#   160 (--prediction self): what an editing client's mostly-right prediction gives;
# - draft model A is the target itself (every greedy draft accepted: the mechanism's ceiling,
#   with a draft as costly as the target), draft model B a random 1.1B llama with the same
#   vocabulary (drafts almost all rejected: the cost of bad drafts and of the off rule).
# Also the verify step's cost against a plain step (the per-row rule's BREAK_EVEN, and where
# --speculate-max-batch should be), and c=32 throughput with speculation on and off.
# Needs MLX (../shared/gpu/README.md), the web wheels in .whl/ and SmolLM2's tokenizer files in
# .gpu/tok/; writes $OUT/spec_*.json and the printed tables to stdout. PART=1 (draft A, mlx-lm,
# the verify cost) and PART=2 (draft B) each fit in one 10-minute job.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH CUDA_CACHE_MAXSIZE=4294967296
[ -f /tmp/r8q/config.json ] || {
  python3 bench/randmodel.py --out /tmp/r8 --tokenizer-from .gpu/tok --size 8b --context 32768
  python3 -m mlx_lm convert --hf-path /tmp/r8 --mlx-path /tmp/r8q -q --q-bits 4
  rm -rf /tmp/r8
}
if [ "${PART:-1}" = 1 ]; then
  python3 bench/speculation.py --model /tmp/r8q --draft-model /tmp/r8q --max-tokens ${TOKENS:-128} \
    --json $OUT/spec_self_draft.json
  python3 bench/experiments/verify_cost.py --model /tmp/r8q --rows 1 4 8 16 32 \
    --drafts 0 2 4 8 16 --context 1024 --json $OUT/spec_verify_cost.json
else
  [ -f /tmp/r1q/config.json ] || {
    python3 bench/randmodel.py --out /tmp/r1 --tokenizer-from .gpu/tok --size 1b --context 32768
    python3 -m mlx_lm convert --hf-path /tmp/r1 --mlx-path /tmp/r1q -q --q-bits 4
    rm -rf /tmp/r1
  }
  python3 bench/speculation.py --model /tmp/r8q --draft-model /tmp/r1q --max-tokens ${TOKENS:-128} \
    --no-mlx-lm --variants off draft --json $OUT/spec_small_draft.json
fi
