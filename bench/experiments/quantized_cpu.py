# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""A quantized model on the CPU: a decode step of R rows with its layers kept quantized (MLX's
quantized matmul) against the same model dequantized to float32 at load (OpenBLAS), and how far
apart their logprobs are.

    python -m bench.experiments.quantized_cpu QUANTIZED_DIR [--rows 8] [--context 256] [--reps 5]

A quantized directory of the embedded model: `python -m mlx_lm convert --hf-path
"$(python -c 'from omlx_logprobs.models.embedded import ensure_embedded_model as e; print(e())')"
-q --mlx-path QUANTIZED_DIR`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.models.loader import load_model


def step_time(net, rows: int, context: int, reps: int) -> tuple[float, np.ndarray]:
    cache = make_prompt_cache(net)
    prompt = mx.random.randint(0, 1000, (rows, context), key=mx.random.key(0))
    mx.eval(net(prompt, cache=cache))
    tok = mx.ones((rows, 1), dtype=mx.int32)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        logits = net(tok, cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), np.array(logits.astype(mx.float32))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    kept = load_model(a.model, dtype="float32").model  # quantized layers, float32 scales
    dense = load_model(a.model).model  # auto: dequantized at load
    t_q, l_q = step_time(kept, a.rows, a.context, a.reps)
    t_d, l_d = step_time(dense, a.rows, a.context, a.reps)

    def lsm(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    diff = float(np.abs(lsm(l_q) - lsm(l_d)).max())
    print(f"decode step, {a.rows} rows at context {a.context}: quantized {t_q * 1000:.1f} ms,"
          f" dequantized float32 {t_d * 1000:.1f} ms ({t_q / t_d:.1f}x);"
          f" max |logprob difference| {diff:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
