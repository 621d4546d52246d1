"""glibc malloc settings for MLX's CPU buffers (Linux only); Python's collector after start-up;
the GIL's switch interval.

MLX's CPU allocator keeps 32 MB of freed buffers and gives the rest to malloc and free. glibc
raises its mmap threshold to the size of any mmapped block freed (up to 32 MiB), so after the
first steps a batch's KV caches and logits (megabytes each, sizes changing every time a row
joins or leaves) are carved from the heap arenas, and the holes they leave stay resident: RSS
climbed by gigabytes under load while live memory stayed flat (docs/reliability.md, "Long
runs"). Pinning the threshold (which also turns the adjustment off) keeps each large buffer on
its own mapping, returned to the kernel when freed; `trim` gives back what the arenas keep.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
# Buffers from this size up get their own mapping. Smaller ones (a layer's activations at a
# small batch) are reused from the arenas step after step, without a page fault each time.
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 8 << 20  # free heap top above this goes back to the kernel at once


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc, not musl: mallopt's numbers differ)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def configure() -> str:
    """Set the thresholds, unless glibc's MALLOC_*_ environment variables already do; one line
    for the server's log. Call before MLX allocates (its buffers are malloc'd as needed)."""
    if _LIBC is None:
        return "system allocator (not glibc)"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "GLIBC_TUNABLES" in os.environ:
        return "glibc malloc, thresholds from the environment"
    ok = _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = _LIBC.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        return "glibc malloc, mallopt refused the thresholds"
    return f"glibc malloc, mmap threshold {MMAP_THRESHOLD >> 10} KiB"


def trim() -> None:
    """Give the kernel the free pages the arenas keep (the engine calls it when it goes idle)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


HEAP = configure()


def freeze_startup_objects() -> None:
    """Once a process has loaded what it keeps (modules, tokenizer, model), move every object
    alive out of the cyclic collector's sight: its full collections then scan only what serving
    made. Without it the server's took ~300 ms on the GPU host, a pause in which no response went
    out and the engine blocked on the full pipe (docs/benchmarks.md, "Decisions")."""
    gc.collect()
    gc.freeze()


def set_switch_interval() -> None:
    """The GIL's switch interval, from OMLX_SWITCH_INTERVAL (seconds; Python's 5 ms unless set),
    in the server's process and in the engine's. A thread that wants the GIL back (the engine
    after `async_eval`, which releases it) waits up to this long while another runs Python."""
    sys.setswitchinterval(float(os.environ.get("OMLX_SWITCH_INTERVAL", "0.005")))
