#!/usr/bin/env bash
# Speculation with a draft model that agrees with its target (bench/agreeing_pair.py:
# a random llama in Llama-3-8B's shape, bfloat16, its layers' writes scaled by $SCALE; the draft
# its first layer, embedding, norm and head): free chat, one stream, top 20, ours without
# speculation, with the draft model and with prompt lookup, and mlx-lm's server without and with
# --draft-model. Set-up and paths: gpu_env.sh; writes $OUT/pair.json. Then the servers' lines on
# speculation's measured costs, and the draft case in-process with its phases timed
# (spec_engine.py --phases). MLX_LM=0 leaves mlx-lm's servers out; PHASES=0 the in-process run.
set -eu
source bench/experiments/gpu_env.sh
agreeing_pair --measure
python3 -m bench.speculation --model $T8 --draft-model $D8 --max-tokens ${TOKENS:-128} \
  --tasks ${TASKS:-chats} --concurrency 0 --variants off draft lookup --json $OUT/pair.json \
  $([ "${MLX_LM:-1}" = 0 ] && echo --no-mlx-lm) 2>&1 | grep -E "tok/s|rror"
grep -h "speculation:\|draft model:" ${TMPDIR:-/tmp}/bench-server-*.log || true
[ "${PHASES:-1}" = 0 ] || python3 -m bench.experiments.spec_engine --model $T8 --draft-model $D8 \
  --rounds ${ROUNDS:-2} --max-tokens ${TOKENS:-128} --cases ${CASES:-chat/draft} --phases 2>&1 | grep -v Warning
