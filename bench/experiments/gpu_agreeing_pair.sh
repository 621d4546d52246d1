#!/usr/bin/env bash
# Speculation with a draft model that agrees with its target (bench/agreeing_pair.py:
# a random llama in Llama-3-8B's shape, bfloat16, its layers' writes scaled by $SCALE; the draft
# its first layer, embedding, norm and head): free chat, one stream, top 20, ours without
# speculation, with the draft model and with prompt lookup, and mlx-lm's server without and with
# --draft-model. Needs MLX (../shared/gpu/README.md), the web wheels in .whl/ and SmolLM2's
# tokenizer files in .gpu/tok/; writes $OUT/pair.json. Then the servers' lines on speculation's
# measured costs, and the draft case in-process with its phases timed (spec_engine.py --phases).
# MLX_LM=0 leaves mlx-lm's servers out; PHASES=0 the in-process run.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} CUDA_CACHE_MAXSIZE=4294967296
python3 bench/agreeing_pair.py --tokenizer-from .gpu/tok --size 8b \
  --layer-scale ${SCALE:-0.0025} --target /tmp/t8 --draft /tmp/d8 --measure
python3 bench/speculation.py --model /tmp/t8 --draft-model /tmp/d8 --max-tokens ${TOKENS:-128} \
  --tasks ${TASKS:-chats} --concurrency 0 --variants off draft lookup --json $OUT/pair.json \
  $([ "${MLX_LM:-1}" = 0 ] && echo --no-mlx-lm) 2>&1 | grep -E "tok/s|rror"
grep -h "speculation:\|draft model:" /tmp/bench-server-*.log || true
[ "${PHASES:-1}" = 0 ] || python3 bench/experiments/spec_engine.py --model /tmp/t8 --draft-model /tmp/d8 --rounds ${ROUNDS:-2} \
  --max-tokens ${TOKENS:-128} --cases ${CASES:-chat/draft} --phases 2>&1 | grep -v Warning
