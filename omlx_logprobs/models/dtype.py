"""The activations' dtype (`--dtype`) and what a quantized model becomes on the CPU.

`auto`: float32 on the CPU (float16 there is slow and, for SmolLM2, off by more than a nat),
the stored dtype on a GPU. On the CPU a quantized model is dequantized to float32 once at load
when it fits in memory: MLX's CPU quantized matmul is many times slower than OpenBLAS's float32
one, and the dequantized weights are exactly the values the quantized matmul computes with
(dequantize(q, scales, biases)), so the logprobs stay the quantized model's.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("omlx_logprobs")

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Memory left to everything else after dequantizing: the caches, the batch, the OS.
_HEADROOM_BYTES = 2 << 30


def _quantized_modules(net: nn.Module) -> list[Any]:
    return [m for _, m in net.named_modules() if hasattr(m, "group_size") and "scales" in m]


def _dequantized_bytes(modules: list[Any]) -> int:
    """The float32 bytes the quantized layers' weights take once dequantized, less the bytes
    they take now."""
    grow = 0
    for m in modules:
        # Each scale covers group_size weights.
        elements = m.scales.size * m.group_size
        now = m.weight.nbytes + m.scales.nbytes + (m.biases.nbytes if "biases" in m else 0)
        grow += elements * 4 - now
    return grow


def _available_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is a dependency; this is a last resort
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def apply_dtype(net: nn.Module, dtype: str = "auto") -> str:
    """Cast `net` for serving; returns what was done, for the log. The log-softmax is float32
    whatever this is (logprobs/extract.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    cpu = mx.default_device() == mx.cpu
    quantized = _quantized_modules(net)
    if dtype == "auto" and not cpu:
        return "stored dtype (auto on a GPU)" + (", quantized" if quantized else "")
    target = mx.float32 if dtype == "auto" else getattr(mx, dtype)
    # Casts the floating parameters, the quantized layers' scales and biases among them
    # (widening them to float32 is exact); the packed weights are integers and stay.
    net.set_dtype(target)
    done = f"{dtype} activations" if dtype != "auto" else "float32 (auto on the CPU)"
    if dtype == "auto" and quantized:
        done += _dequantize_if_it_fits(net, quantized)
    elif quantized:
        done += ", quantized layers kept"
    return done


def _dequantize_if_it_fits(net: nn.Module, quantized: list[Any]) -> str:
    from mlx_lm.utils import dequantize_model

    need, have = _dequantized_bytes(quantized), _available_bytes()
    if need + _HEADROOM_BYTES > have:
        log.warning(
            "the quantized weights stay quantized: dequantized to float32 they would need"
            " %.1f GiB more, and %.1f GiB is free; MLX's quantized matmul is slow on the CPU",
            need / 2**30,
            have / 2**30,
        )
        return ", quantized layers kept (too large to dequantize)"
    dequantize_model(net)
    # mxfp4's scales are 8-bit exponents (left as they are by the cast above), so its weights
    # dequantize to MLX's default float type: widen them (exactly) to float32 too.
    net.set_dtype(mx.float32)
    return (
        f", {len(quantized)} quantized layers dequantized to float32 at load"
        f" (+{need / 2**30:.2f} GiB; the logprobs are the quantized model's)"
    )
