# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""The CPU backend's extraction as the engine pays it when a step is collected
(`HostExtraction.to_host`: numpy log-softmax, rank, top k) on random logits; medians in ms.

python -m bench.experiments.host_extract_bench --batch 8 32 64 --k 0 5 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx
import numpy as np

from omlx_logprobs.logprobs.extract import HostExtraction


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, nargs="+", default=[0, 5, 20])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for b in a.batch:
        x = mx.array((rng.standard_normal((b, a.vocab)) * 3).astype(np.float32))
        chosen = mx.array(rng.integers(0, a.vocab, b).astype(np.int32))
        mx.eval(x, chosen)
        cells = []
        for k in a.k:
            h = HostExtraction(x, chosen, k, None, True)
            h.to_host()
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                h.to_host()
                times.append(time.perf_counter() - t0)
            cells.append(f"k={k} {1e3 * statistics.median(times):.2f} ms")
        print(f"batch {b}, vocab {a.vocab}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
