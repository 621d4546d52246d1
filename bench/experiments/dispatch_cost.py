"""What MLX's `async_eval` costs the host per operation, on the GPU: chains of K small
elementwise ops and of K matmuls, each timed as graph building (Python) and `async_eval`
(MLX walking the graph and launching each kernel), alone and with the previous chain still on
the device (as the engine's overlap has it). Then the engine's own decode step at 64 rows: how
many primitives its graph holds, so that the step's `async_eval` time divides into a cost per
primitive. Run it once per MLX setting (they are read once per process):

    python3 -m bench.experiments.dispatch_cost --model $M1B
    MLX_USE_CUDA_GRAPHS=1 python3 -m bench.experiments.dispatch_cost --model $M1B
    MLX_MAX_OPS_PER_BUFFER=2000 python3 -m bench.experiments.dispatch_cost --model $M1B
    OMLX_DECODE_ATTENTION=mlx python3 -m bench.experiments.dispatch_cost --model $M1B \
        --skip-synthetic
    python3 -m bench.experiments.dispatch_cost --model $M1B --skip-synthetic \
        --alternate fusion --steps 128

`--drop-decode-mask` gives a decode step's attention no mask (wrong values; after the start-up
probe): what a fused masked attention could save, before runner/fast/attention.py existed.
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import replace

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.cli import mlx_environment


def chain(kind: str, k: int, x: mx.array, w: mx.array) -> mx.array:
    for _ in range(k):
        x = x @ w if kind == "matmul" else x + 1
    return x


def timed(kind: str, k: int, reps: int, overlap: bool) -> tuple[float, float, float]:
    """Median build, `async_eval` and build-to-done times of a K-op chain, ms."""
    x = mx.random.normal((64, 2048)).astype(mx.bfloat16)
    w = (mx.random.normal((2048, 2048)) * 0.02).astype(mx.bfloat16)
    mx.eval(x, w)
    builds, evals, totals = [], [], []
    prev = None
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        y = chain(kind, k, x, w)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        if overlap and prev is not None:
            mx.eval(prev)  # the previous chain, as the engine collects step N-1 after N launched
        else:
            mx.eval(y)
        t3 = time.perf_counter()
        prev = y
        builds.append(t1 - t0)
        evals.append(t2 - t1)
        totals.append(t3 - t0)
    mx.eval(prev)
    med = [statistics.median(v[2:]) * 1e3 for v in (builds, evals, totals)]
    return med[0], med[1], med[2]


def count_primitives(arrays: list[mx.array]) -> int:
    """Primitive nodes of a graph not yet evaluated (from MLX's DOT export, where primitives
    are the rectangles); prints the most common ones."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        text = open(f.name).read()
    labels = re.findall(r'label ="([^"]*)", shape=rectangle', text)
    print("  primitives:", Counter(labels).most_common(25), flush=True)
    return len(labels)


LEAN_PATH = "omlx_logprobs/runner/fast/lean_decode.py"


def engine_step(
    model: str, rows: int, steps: int, drop_mask: bool, alternate: str | None, old_tree: str
) -> None:
    from omlx_logprobs.config import EngineConfig
    from omlx_logprobs.runner.fast import attention, compiled, fusion
    from omlx_logprobs.engine.engine import Engine
    from omlx_logprobs.batch.sequence import Sequence
    from omlx_logprobs.models.loader import load_model
    from omlx_logprobs.types import SamplingParams

    loaded = load_model(None if model == "embedded" else model)
    engine = Engine(loaded.model, loaded.vocab, loaded.eos_token_ids, EngineConfig())
    if drop_mask:  # after the start-up probe, which would refuse it
        sdpa = mx.fast.scaled_dot_product_attention

        def unmasked(q, k, v, *, scale, mask=None, **kw):  # type: ignore[no-untyped-def]
            if q.shape[2] == 1 and isinstance(mask, mx.array):
                mask = None
            return sdpa(q, k, v, scale=scale, mask=mask, **kw)

        mx.fast.scaled_dot_product_attention = unmasked
    real = mx.async_eval
    calls: list[tuple[float, int]] = []
    cpu: list[float] = []  # the calling thread's CPU time in each call: dispatch, not waiting
    starts: list[float] = []
    counting = {"on": False}

    def wrapped(*arrays):  # type: ignore[no-untyped-def]
        n = count_primitives(list(arrays)) if counting["on"] else -1
        t0, c0 = time.perf_counter(), time.thread_time()
        real(*arrays)
        calls.append((time.perf_counter() - t0, n))
        cpu.append(time.thread_time() - c0)
        starts.append(t0)

    mx.async_eval = wrapped  # type: ignore[assignment]
    words = "the quick brown fox jumps over a lazy dog " * 2
    waves: list[tuple[int, str]] = [(-1, "-"), (20, "-"), (-1, "-"), (20, "-")]
    routes = {
        "attention": ("kernel", "mlx"),
        "fusion": ("joined", "separate"),
        "lean": ("lean", "model"),
        "compiled": ("compiled", "lean"),
        "views": ("split", "sliced"),
        "tree": ("new", "old"),
    }
    old_lean = None
    if alternate == "tree":  # the older tree's runner/fast/lean_decode.py, on this model and fusion
        spec = importlib.util.spec_from_file_location("old_lean", f"{old_tree}/{LEAN_PATH}")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        old_lean = module.LeanDecode(loaded.model, engine.runner.fusion)

    split = mx.split

    def sliced(a: mx.array, indices: list[int], axis: int) -> list[mx.array]:
        """`mx.split` as one slice a part (one graph node each), along axis 1."""
        bounds = [0, *indices, a.shape[axis]]
        return [a[:, s:e] for s, e in zip(bounds, bounds[1:])]

    lean = engine.runner.plan.decode
    traced = compiled.CompiledDecode(loaded.model, lean) if alternate == "compiled" else None
    if alternate:  # the two routes wave by wave in this one process
        waves = [(t, r) for _ in range(4) for r in routes[alternate] for t in (-1, 20)]
    periods: dict[tuple[int, str], list[float]] = {}
    for top, route in waves:
        if route in ("kernel", "mlx"):
            mx.fast.scaled_dot_product_attention = (
                attention._sdpa if route == "kernel" else attention._mlx_sdpa
            )
        elif route in ("lean", "model"):  # runner/fast/lean_decode.py's step or the model's forward
            engine.runner.plan = replace(
                engine.runner.plan, decode=lean if route == "lean" else None
            )
        elif route in ("new", "old"):  # this tree's lean step or the older tree's
            engine.runner.plan = replace(
                engine.runner.plan, decode=lean if route == "new" else old_lean
            )
        elif route == "compiled":  # the lean step traced by runner/fast/compiled.py
            engine.runner.plan = replace(engine.runner.plan, decode=traced)
        elif route in ("split", "sliced"):  # the lean step's parts by split or by slices,
            # attention over the caches' full width or their written columns
            mx.split = split if route == "split" else sliced  # type: ignore[assignment]
            lean.full_width = route == "split"
        elif route != "-":  # a member's own arrays are views of its group's: either way works
            for group in engine.runner.fusion.groups:
                for m in group.members:
                    m.__class__ = (
                        fusion._MEMBER_CLASSES[group.base] if route == "joined" else group.base
                    )
        params = SamplingParams(
            max_tokens=steps,
            temperature=0,
            ignore_eos=True,
            logprobs=top >= 0,
            top_logprobs=max(top, 0),
        )
        for i in range(rows):
            ids = list(loaded.tokenizer.encode(f"{i} {words}"))
            engine.scheduler.add(Sequence(f"r{i}-{top}", ids, params))
        calls.clear()
        cpu.clear()
        starts.clear()
        n_steps = 0
        while engine.has_work():
            n_steps += 1
            counting["on"] = n_steps == steps // 2  # one decode step in the middle
            engine.step()
        counted = [n for _, n in calls if n >= 0]
        times = sorted(t for t, _ in calls)
        mode = ("off" if top < 0 else f"top {top}") + ("" if route == "-" else f", {route}")
        diffs = [b - a for a, b in zip(starts, starts[1:])]
        period = statistics.median(diffs[len(diffs) // 4 :])  # past the prefills
        p90 = times[int(len(times) * 0.9)]
        print(
            f"engine {mode}: {len(calls)} async_eval calls, median "
            f"{statistics.median(times) * 1e3:.2f} ms (thread CPU "
            f"{statistics.median(cpu) * 1e3:.2f} ms), p90 {p90 * 1e3:.2f} ms; step period "
            f"{period * 1e3:.2f} ms; primitives in a "
            f"mid decode step's graph: {counted}",
            flush=True,
        )
        periods.setdefault((top, route), []).append(period)
    mx.async_eval = real  # type: ignore[assignment]
    if alternate:
        for (top, route), ps in periods.items():
            print(
                f"step period, {top=} {route}: median {statistics.median(ps) * 1e3:.2f} ms of "
                f"{' '.join(f'{p * 1e3:.2f}' for p in ps)}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skip-synthetic", action="store_true")
    alt_help = (
        "waves alternate, in one process: runner/fast/attention.py's kernel and MLX's attention"
        " (attention), joined and separate projections (fusion, runner/fast/fusion.py), or the lean"
        " llama step and the model's forward (lean, runner/fast/lean_decode.py), the lean step"
        " traced by runner/fast/compiled.py and as it is (compiled), the lean step's q/k/v and"
        " gate/up parts by one split and attention over the caches' full width, or by slices"
        " (views), this tree's lean step or --old-tree's (tree)"
    )
    ap.add_argument(
        "--alternate",
        choices=["attention", "fusion", "lean", "compiled", "views", "tree"],
        help=alt_help,
    )
    ap.add_argument("--old-tree", default=".gpu/old", help="with --alternate tree: its root")
    drop_help = (
        "decode attention without its mask (wrong values): the bound of a fused masked kernel"
    )
    ap.add_argument("--drop-decode-mask", action="store_true", help=drop_help)
    a = ap.parse_args()

    mlx_environment()
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    print("MLX environment:", env, "device:", mx.default_device(), flush=True)
    for kind, k in (
        ()
        if a.skip_synthetic
        else (("add", 100), ("add", 400), ("matmul", 100 if mx.default_device() == mx.gpu else 2))
    ):
        for overlap in (False, True):
            b, e, t = timed(kind, k, a.reps, overlap)
            print(
                f"{kind} x{k} {'overlapped' if overlap else 'alone':10s}: build {b:.2f} ms "
                f"({b / k * 1e3:.1f} us/op), async_eval {e:.2f} ms ({e / k * 1e3:.1f} us/op), "
                f"to done {t:.2f} ms",
                flush=True,
            )
    if a.model:
        engine_step(a.model, a.rows, a.steps, a.drop_decode_mask, a.alternate, a.old_tree)


if __name__ == "__main__":
    main()
