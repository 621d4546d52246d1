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
