#!/usr/bin/env bash
# Fast CPU matmuls on Linux: mlx[cpu] links a reference BLAS, so we load OpenBLAS before mlx
# (omlx_logprobs/blas.py). Install Debian's OpenBLAS when we can; warn when we cannot.
set -u
[ "$(uname -s)" = "Linux" ] || exit 0
if ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  echo "OpenBLAS: present"; exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "OpenBLAS: installing Debian's libopenblas0-pthread"
  (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 || \
   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1)) \
    && { echo "OpenBLAS: installed"; exit 0; }
fi
echo "WARNING: no OpenBLAS found and it could not be installed; MLX will use its reference BLAS" >&2
echo "         (about 40x slower matmuls). Install it with: sudo apt-get install libopenblas0-pthread" >&2
exit 0
