"""Load OpenBLAS ahead of MLX on Linux.

The `mlx[cpu]` wheel links a bundled reference BLAS. A library loaded earlier with RTLD_GLOBAL wins
symbol resolution, so OpenBLAS must be loaded before the first `import mlx`; later has no effect.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("omlx_logprobs")

_CANDIDATES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp-r0.so")


def _already_imported_mlx() -> bool:
    return "mlx.core" in sys.modules


def load_openblas() -> str:
    """Preload OpenBLAS when possible and return a one-line description of the BLAS in use."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if os.environ.get("OMLX_BLAS", "") == "reference":
        return "reference BLAS (OMLX_BLAS=reference)"
    late = _already_imported_mlx()
    names = [os.environ["OMLX_BLAS"]] if os.environ.get("OMLX_BLAS") else []
    found = ctypes.util.find_library("openblas")
    names += [found] if found else []
    names += list(_CANDIDATES)
    for name in names:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if late:
            return f"reference BLAS (OpenBLAS {name} loaded after mlx, so unused)"
        return f"OpenBLAS ({name})"
    return "reference BLAS (no OpenBLAS found: sudo apt-get install libopenblas0-pthread)"


BLAS = load_openblas()


# numpy's bundled OpenBLAS (its Linux wheels' own copy, apart from the one MLX computes with)
# and the names its builds give the thread setter.
_NUMPY_BLAS_GLOBS = ("numpy.libs/*openblas*", "numpy/.libs/*openblas*")
_SET_THREADS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def numpy_blas_threads(n: int) -> bool:
    """Set numpy's own OpenBLAS to `n` threads; False where there is none to set (macOS's
    Accelerate, a numpy built on the system's BLAS). Host-side prefill attention
    (runner/query_blocks.py) runs numpy's matmuls between MLX's: OpenBLAS's workers spin after
    each call, so two pools of workers on the same cores take turns waiting for each other (an
    image's first turn on the 2-core box: 6-17 s with numpy's two threads, 2.2-3.7 s with one;
    a 2,500-token prompt: 56-64 s against 31-48 s)."""
    import glob
    from pathlib import Path

    import numpy

    site = Path(numpy.__file__).parent.parent
    for pattern in _NUMPY_BLAS_GLOBS:
        for path in sorted(glob.glob(str(site / pattern))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name in _SET_THREADS:
                setter = getattr(lib, name, None)
                if setter is not None:
                    setter(ctypes.c_int(n))
                    return True
    return False
