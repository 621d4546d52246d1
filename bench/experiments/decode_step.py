"""Median decode-step time of the engine at one concurrency, on the embedded model: a before/after
check of a change to the batch's host-side work that holds on a busy machine (a median of
steps, wall and process CPU time, rather than a run's throughput).

    PYTHONPATH=TREE python bench/experiments/decode_step.py --rows 8 --steps 64
Run it once per tree, alternating, and compare the medians.
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import statistics
import time

import omlx_logprobs  # noqa: F401
from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=20, help="top logprobs (0: none)")
    a = ap.parse_args()
    mlx_environment()
    model = load_model(None)
    engine = Engine(model.model, model.vocab, model.eos_token_ids, EngineConfig())
    params = SamplingParams(
        max_tokens=a.steps, temperature=0, ignore_eos=True, logprobs=a.top > 0, top_logprobs=a.top
    )
    words = "the quick brown fox jumps over a lazy dog " * 2
    for i in range(a.rows):
        ids = list(model.tokenizer.encode(f"{i} {words}"))
        engine.scheduler.add(Sequence(f"r{i}", ids, params))
    wall, cpu = [], []
    while engine.has_work():
        full = len(engine.scheduler.running) == a.rows and not engine.scheduler.waiting
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        if full:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    print(
        f"rows {a.rows} top {a.top}: median step {statistics.median(wall) * 1e3:.2f} ms wall, "
        f"{statistics.median(cpu) * 1e3:.2f} ms cpu over {len(wall)} steps"
    )


if __name__ == "__main__":
    main()
