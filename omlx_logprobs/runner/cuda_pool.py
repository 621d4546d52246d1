"""How much freed device memory CUDA's stream-ordered pool keeps mapped (MLX's CUDA backend
allocates from the device's default pool with cudaMallocAsync).

Past MLX's own buffer cache (`mx.set_cache_limit`), a freed buffer goes back to that pool, and
with the pool's default release threshold (0) the pool unmaps it at the next synchronisation:
the next large allocation maps its pages again. On an H100 a long conversation's turn that
freed gigabytes (an evicted prefix, a finished 20k-token row) stalled its next allocation for
about 290 ms that way, once every few turns. A threshold keeps that much memory mapped in the
pool, to be reused by an allocation of any size (MLX's cache reuses only similar sizes).

MLX links the CUDA runtime statically, so the pool is reached through the driver (libcuda),
whose default pool per device is the runtime's too.
"""

from __future__ import annotations

import ctypes
import logging

import mlx.core as mx

log = logging.getLogger("omlx_logprobs")

_RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD


def retain(nbytes: int, device: int = 0) -> bool:
    """Let the device's default pool keep up to `nbytes` of freed memory mapped. False where
    there is no CUDA device or the driver refuses (the pool then behaves as CUDA's default)."""
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return False
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, pool = ctypes.c_int(), ctypes.c_void_p()
        value = ctypes.c_uint64(nbytes)
        for code in (
            cuda.cuDeviceGet(ctypes.byref(dev), device),
            cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev),
            cuda.cuMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(value)),
        ):
            if code != 0:
                raise OSError(f"CUDA driver error {code}")
    except OSError as e:
        log.warning("CUDA's memory pool keeps its default release threshold: %s", e)
        return False
    log.info("CUDA's memory pool keeps up to %d MiB of freed memory mapped", nbytes >> 20)
    return True
