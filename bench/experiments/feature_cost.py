"""What a feature costs a request it does not help, in-process on the engine thread (no HTTP):
one engine built as `serve` builds it (a config of its defaults, one flag changed), one stream of
requests one after another, then waves of C rows; the step period and the engine's launch,
queue and complete times per decode step. Each run is one process: alternate the variants.

    python3 -m bench.experiments.feature_cost --model $M1B --variant default
    python3 -m bench.experiments.feature_cost --model $M1B --variant no-prefix-cache

Variants: default; no-prefix-cache (--prefix-cache-mib 0); no-keep (the cache on, finished
sequences not kept); no-speculate (--speculate off). `--profile` prints a cProfile of the one
stream's steps.
"""

# ruff: noqa: I001, E402  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import logging
import pstats
import statistics
import threading
import time
from typing import Any

import omlx_logprobs  # noqa: F401
from omlx_logprobs.cli import mlx_environment

mlx_environment()

from omlx_logprobs.options import build_parser
from omlx_logprobs.serve_config import engine_config
from omlx_logprobs.engine.commands import Submit
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.types import EngineRequest, SamplingParams

from bench.loadgen import make_prompt

VARIANTS = {
    "default": {},
    "no-prefix-cache": {"prefix_cache_mib": 0},
    "no-keep": {},
    "no-speculate": {"speculate": "off"},
}


def prompt(tok: Any, i: int, words: int) -> list[int]:
    """bench/loadgen.py's prompt i, chat-templated: the template's system turn shared, the user
    turn distinct."""
    msgs = [{"role": "user", "content": make_prompt(i, words)}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


class Run:
    """The engine on its own thread; requests in, each finished request's event set."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.done: dict[str, threading.Event] = {}
        self.steps: list[tuple[float, int, int, float, float, float]] = []
        engine.sink = self._sink
        add = engine.stats.add

        def record(n, prefill, cached, launch_s, complete_s, device):  # type: ignore[no-untyped-def]
            self.steps.append(
                (time.perf_counter(), n, prefill, launch_s, complete_s, device.queue_s)
            )
            add(n, prefill, cached, launch_s, complete_s, device)

        engine.stats.add = record  # type: ignore[method-assign]

    def _sink(self, outputs: list[Any]) -> None:
        for o in outputs:
            if o.finished:
                if o.error:
                    print("error", o.request_id, o.error, flush=True)
                self.done[o.request_id].set()

    def submit(self, rid: str, ids: list[int], params: SamplingParams) -> threading.Event:
        ev = self.done[rid] = threading.Event()
        self.engine.post(Submit(EngineRequest(rid, ids, params)))
        return ev


def summary(steps: list[tuple[float, int, int, float, float, float]], rows: int) -> str:
    """Decode-only steps with `rows` rows: the period between consecutive ones, the launch, its
    async_eval part and the complete part (ms, medians)."""
    period = [
        b[0] - a[0]
        for a, b in zip(steps, steps[1:])
        if a[1] == b[1] == rows and not a[2] and not b[2]
    ]
    mine = [s for s in steps if s[1] == rows and not s[2]]
    if not mine or not period:
        return "no steps"
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return (
        f"period {med(period):.3f} launch {med([s[3] for s in mine]):.3f} "
        f"queue {med([s[5] for s in mine]):.3f} complete {med([s[4] for s in mine]):.3f} "
        f"(mean {statistics.mean(s[4] for s in mine) * 1e3:.3f}) steps {len(mine)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="default")
    ap.add_argument("--stream-requests", type=int, default=12)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--words", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    loaded = load_model(a.model)
    serve = build_parser().parse_args(["serve", "--max-num-seqs", str(max(a.rows, 64))])
    cfg = dataclasses.replace(engine_config(serve), **VARIANTS[a.variant])  # as `serve` makes it
    engine = Engine(
        loaded.model, loaded.vocab, loaded.eos_token_ids, cfg, tokenizer=loaded.tokenizer
    )
    if a.variant == "no-keep":
        engine.runner.keeps_finished = False
    run = Run(engine)
    t0 = time.perf_counter()
    engine.start()
    print(f"[{a.variant}] started (warms) in {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=0, ignore_eos=True, logprobs=a.top >= 0,
        top_logprobs=max(a.top, 0),
    )  # fmt: skip
    tok = loaded.tokenizer
    prof = cProfile.Profile() if a.profile else None
    run.submit("warm", prompt(tok, 10_000, a.words), params).wait()
    run.steps.clear()
    t0 = time.perf_counter()
    for i in range(a.stream_requests):
        if prof is not None and i == 2:
            prof.enable()
        run.submit(f"s{i}", prompt(tok, i, a.words), params).wait()
    if prof is not None:
        prof.disable()
    el = time.perf_counter() - t0
    tps = a.stream_requests * a.max_tokens / el
    print(f"[{a.variant}] c=1: {tps:.1f} tok/s; {summary(run.steps, 1)}", flush=True)
    for w in range(a.waves):
        run.steps.clear()
        t0 = time.perf_counter()
        evs = [
            run.submit(f"w{w}-{i}", prompt(tok, 1000 * (w + 1) + i, a.words), params)
            for i in range(a.rows)
        ]
        for ev in evs:
            ev.wait()
        el = time.perf_counter() - t0
        print(
            f"[{a.variant}] c={a.rows} wave {w}: {a.rows * a.max_tokens / el:.0f} tok/s; "
            f"{summary(run.steps, a.rows)}",
            flush=True,
        )
    kept = engine.runner.prefixes
    print(f"[{a.variant}] kept: {len(kept.entries) if kept else 0} entries, "
          f"{(kept.nbytes if kept else 0) / 2**20:.0f} MiB", flush=True)  # fmt: skip
    engine.shutdown()
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
