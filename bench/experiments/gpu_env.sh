# Sourced by the gpu_*.sh scripts, from the repo root: the GPU host's set-up, every path taken
# from the environment so that no script carries one host's layout.
#   MLX_ENV  a file to source that puts MLX with its CUDA backend on the path (the GPU set-up in
#            ../shared/gpu/README.md writes one); unset: python3 has MLX already.
#   WHEELS   a folder of the server's wheels (default .whl), installed into SITE when it exists,
#            for a host with no package index; SITE defaults to $TMPDIR/omlx-site.
#   TOK      SmolLM2's tokenizer files, which the random models take (default .gpu/tok).
#   MODELS   where the random models are built once and kept (default ~/.cache/omlx-bench);
#            M1B, R8Q, R1Q, T8 and D8 name each model's folder in it unless set.
#   OUT      where results and logs go (default $TMPDIR/omlx-bench).
[ -z "${MLX_ENV:-}" ] || source "$MLX_ENV"
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-${TMPDIR:-/tmp}/omlx-site}
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl 2>/dev/null
fi
# The wheels in SITE, then the checkout's package, not an installed one (`-m` puts the root first
# anyway; host_step.py, run as a file, needs it).
export PYTHONPATH=$SITE:$PWD:${PYTHONPATH:-} CUDA_CACHE_MAXSIZE=4294967296
TOK=${TOK:-.gpu/tok}
MODELS=${MODELS:-$HOME/.cache/omlx-bench}
OUT=${OUT:-${TMPDIR:-/tmp}/omlx-bench}
mkdir -p "$MODELS" "$OUT"
M1B=${M1B:-$MODELS/m1b}  # the gpu preset's random 1.1B llama, bfloat16
R8Q=${R8Q:-$MODELS/r8q}  # a random llama in Llama-3-8B's shape, 4-bit, 32k context
R1Q=${R1Q:-$MODELS/r1q}  # a random 1.1B llama, 4-bit, 32k context (a draft that is rejected)
T8=${T8:-$MODELS/t8}     # bench/agreeing_pair.py's 8B target, bfloat16
D8=${D8:-$MODELS/d8}     # and its draft

random_model() {  # DIR randmodel.py flags...: built once
  local dir=$1; shift
  [ -f "$dir/config.json" ] || python3 -m bench.randmodel --out "$dir" --tokenizer-from "$TOK" "$@" >/dev/null
}
model_m1b() { random_model "$M1B" --size 1b; }
model_r8q() { random_model "$R8Q" --size 8b --bits 4 --context 32768; }
model_r1q() { random_model "$R1Q" --size 1b --bits 4 --context 32768; }
agreeing_pair() {  # [--measure]: bench/agreeing_pair.py's pair, its layers' writes scaled by SCALE
  python3 -m bench.agreeing_pair --tokenizer-from "$TOK" --size 8b --layer-scale "${SCALE:-0.0025}" \
    --target "$T8" --draft "$D8" "$@"
}
