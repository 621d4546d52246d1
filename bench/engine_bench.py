"""Engine-level throughput with no HTTP: our engine's step loop against bare mlx-lm
`BatchGenerator`, on the same model, prompts and output lengths, in one process.

Each cell submits `batch` requests at once (random-id prompts, fixed output length, EOS ignored)
and times until the last one finishes, so prefill and decode both count, as in a closed-loop
wave of the HTTP benchmark.

    python -m bench.engine_bench --model DIR --batch 8 32 64 --max-tokens 128
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.types import SamplingParams


@dataclass(frozen=True)
class Result:
    target: str  # "omlx" or "batchgen"
    mode: str  # "off", "top0", "top5", "top20"
    batch: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def greedy_params(max_tokens: int, top: int | None) -> SamplingParams:
    """Fixed-length greedy requests; `top` None: logprobs off."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=top is not None,
        top_logprobs=top or 0,
    )


def run_omlx(m: LoadedModel, batch: list[list[int]], max_tokens: int, top: int | None) -> int:
    cfg = EngineConfig(max_num_seqs=max(64, len(batch)))
    engine = Engine(m.model, m.vocab, m.eos_token_ids, cfg)
    params = greedy_params(max_tokens, top)
    seqs = [Sequence(f"b{i}", p, params) for i, p in enumerate(batch)]
    for s in seqs:
        engine.scheduler.add(s)
    while engine.has_work():  # the engine thread's loop, inline
        engine.step()
    return sum(s.num_output for s in seqs)


def run_closed_loop(
    m: LoadedModel,
    n: int,
    total: int,
    max_tokens: int,
    top: int | None,
    seed: int = 0,
    stagger: bool = False,
) -> int:
    """`n` requests always in flight, each replaced by a new one (prompt of 24 to 72 random
    tokens) when it finishes, until `total` are done: the HTTP benchmark's shape, without HTTP.
    `stagger`: at most one new request a step, so requests finish at different steps and the
    batch changes almost every step, as it does behind the HTTP server."""
    rng = random.Random(seed)
    engine = Engine(m.model, m.vocab, m.eos_token_ids, EngineConfig(max_num_seqs=max(64, n)))
    params = greedy_params(max_tokens, top)
    started, live, done = 0, [], 0
    while done < total:
        room = 1 if stagger else n
        while len(live) < n and started < total and room > 0:
            room -= 1
            prompt = [rng.randrange(100, len(m.vocab) - 100) for _ in range(rng.randint(24, 72))]
            live.append(Sequence(f"c{started}", prompt, params))
            engine.scheduler.add(live[-1])
            started += 1
        engine.step()
        finished = [s for s in live if s.finish_reason is not None]
        done += len(finished)
        live = [s for s in live if s.finish_reason is None]
    while engine.has_work():
        engine.step()
    return done * max_tokens


def run_batchgen(
    m: LoadedModel, batch: list[list[int]], max_tokens: int, batch_size: int | None = None
) -> int:
    """Generate `max_tokens` for every prompt (no stop tokens), at most `batch_size` at a time
    (default: all), as mlx-lm's own continuous batching schedules them; return the token count."""
    size = batch_size or len(batch)
    gen = BatchGenerator(
        m.model,
        max_tokens=max_tokens,
        completion_batch_size=size,
        prefill_batch_size=min(size, 8),  # mlx-lm's default, fewer for small batches
    )
    gen.insert(batch, max_tokens=[max_tokens] * len(batch))
    tokens = 0
    while responses := gen.next_generated():
        tokens += len(responses)
    gen.close()
    return tokens


def cell(m: LoadedModel, target: str, mode: str, n: int, args: argparse.Namespace) -> Result:
    batch = prompts(n, args.prompt_len, len(m.vocab), seed=n)
    top = None if mode == "off" else int(mode[3:])
    t0 = time.perf_counter()
    if target == "omlx" and args.closed_loop:
        total = n * args.closed_loop
        tokens = run_closed_loop(m, n, total, args.max_tokens, top, stagger=args.stagger)
    elif target == "omlx":
        tokens = run_omlx(m, batch, args.max_tokens, top)
    else:
        tokens = run_batchgen(m, batch, args.max_tokens)
    return Result(target, mode, n, tokens, time.perf_counter() - t0)


def profile(m: LoadedModel, mode: str, n: int, a: argparse.Namespace) -> int:
    """Where the host thread's time goes in one cell (waits for the device show as collect)."""
    import cProfile
    import pstats

    cell(m, "omlx", mode, n, a)
    prof = cProfile.Profile()
    prof.enable()
    r = cell(m, "omlx", mode, n, a)
    prof.disable()
    print(f"batch {n} {mode}: {r.tokens_per_s:.1f} tok/s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="mlx-lm dir or .gguf; default: embedded")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["off", "top0", "top5", "top20"])
    ap.add_argument("--rounds", type=int, default=2, help="repeat each cell, keep the best")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--threaded", action="store_true", help="run on a thread, not the main one")
    ap.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        metavar="WAVES",
        help="our engine in a closed loop of WAVES x batch requests (BatchGenerator: one wave)",
    )
    ap.add_argument(
        "--stagger", action="store_true", help="closed loop: at most one new request a step"
    )
    ap.add_argument("--profile", default=None, help="MODE: profile our engine at the last batch")
    a = ap.parse_args(argv)
    if a.threaded:  # everything MLX on one other thread, as the server's engine thread
        box: list[int] = []
        t = threading.Thread(target=lambda: box.append(run(a)))
        t.start()
        t.join()
        return box[0] if box else 1
    return run(a)


def run(a: argparse.Namespace) -> int:
    m = load_model(a.model)
    print(f"device {mx.default_device()}, model {m.path}", file=sys.stderr)
    cell(m, "omlx", "top20", 2, a)  # warm-up: compile kernels, first allocations
    cell(m, "batchgen", "off", 2, a)
    if a.profile:
        return profile(m, a.profile, a.batch[-1], a)
    results: list[Result] = []
    for n in a.batch:
        runs = [("batchgen", "off")] + [("omlx", mode) for mode in a.modes]
        for target, mode in runs:
            best = max(
                (cell(m, target, mode, n, a) for _ in range(a.rounds)),
                key=lambda r: r.tokens_per_s,
            )
            results.append(best)
            print(
                f"batch {n:3d} {target:9s} {mode:6s} {best.tokens_per_s:9.1f} tok/s "
                f"({best.tokens} tokens in {best.seconds:.2f} s)",
                flush=True,
            )
        base = next(r for r in results if r.batch == n and r.target == "batchgen")
        off = next(
            (r for r in results if r.batch == n and r.mode == "off" and r.target == "omlx"), None
        )
        for r in results:
            if r.batch == n and r.target == "omlx":
                vs_off = f", vs our off {r.tokens_per_s / off.tokens_per_s:.2f}x" if off else ""
                ratio = r.tokens_per_s / base.tokens_per_s
                print(f"  {r.mode:6s} vs batchgen {ratio:.2f}x{vs_off}")
    if a.json:
        a.json.write_text(json.dumps([asdict(r) | {"tok_s": r.tokens_per_s} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
