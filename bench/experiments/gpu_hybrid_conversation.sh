#!/usr/bin/env bash
# The multi-turn agent trace (bench/conversation.py) on a hybrid model, on the GPU host: a random
# Qwen3.5-shaped 9B (gated delta layers, every fourth full attention), 4-bit, 32k context; 8
# turns growing to ~24k tokens; ours with the prefix cache (sequences kept whole with their
# states), ours without, mlx-lm's server. Needs MLX (../shared/gpu/README.md), the web wheels in
# .whl/ and SmolLM2's tokenizer files in .gpu/tok/; writes $OUT/hybrid_conversation.json.
set -eu
source /root/mlxenv.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
date +"model: %T"; python3 bench/randmodel.py --out /root/h9q --tokenizer-from .gpu/tok --size hybrid-9b --bits 4 \
  --context 32768 > /dev/null
date +"servers: %T"; python3 bench/conversation.py --model /root/h9q --turns ${TURNS:-8} --tool-words ${WORDS:-800} \
  --json $OUT/hybrid_conversation.json --logs $OUT ${FLAGS:-}
