#!/usr/bin/env bash
# Speculative decoding on the GPU host (bench/speculation.py, bench/experiments/verify_cost.py):
# a random llama in Llama-3-8B's shape, 4-bit ($R8Q), one stream with logprobs (top 20, greedy).
# Random weights follow no task, so:
# - the editing request's prediction is the model's own answer with a character changed every
#   160 (--prediction self): what an editing client's mostly-right prediction gives;
# - draft model A is the target itself (every greedy draft accepted: the mechanism's ceiling,
#   with a draft as costly as the target), draft model B a random 1.1B llama with the same
#   vocabulary ($R1Q; drafts almost all rejected: the cost of bad drafts and of the off rule).
# Also the verify step's cost against a plain step (the per-row rule's BREAK_EVEN, and where
# --speculate-max-batch should be), and c=32 throughput with speculation on and off.
# Set-up and paths: gpu_env.sh; writes $OUT/spec_*.json and the printed tables to stdout. PART=1
# (draft A, mlx-lm, the verify cost) and PART=2 (draft B) each fit in one 10-minute job.
set -eu
source bench/experiments/gpu_env.sh
model_r8q
if [ "${PART:-1}" = 1 ]; then
  python3 -m bench.speculation --model $R8Q --draft-model $R8Q --max-tokens ${TOKENS:-128} \
    --json $OUT/spec_self_draft.json
  python3 -m bench.experiments.verify_cost --model $R8Q --rows 1 4 8 16 32 \
    --drafts 0 2 4 8 16 --context 1024 --json $OUT/spec_verify_cost.json
else
  model_r1q
  python3 -m bench.speculation --model $R8Q --draft-model $R1Q --max-tokens ${TOKENS:-128} \
    --no-mlx-lm --variants off draft --json $OUT/spec_small_draft.json
fi
