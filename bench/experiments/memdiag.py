"""Where does the server's resident memory go? A diagnosis tool, not a test.

`python -m bench.experiments.memdiag serve` runs the real server (embedded SmolLM2-135M, uvicorn in
the main thread as `omlx-logprobs serve` does) and, from a side thread, sends waves of soak-like
requests from a separate client process. At each idle point between waves it prints one JSON line:
RSS, glibc's heap accounting (mallinfo2: bytes in use vs bytes free but kept), Python's live blocks
and gc objects by type (growth since the first wave), MLX's active and cache memory, and with
`--tracemalloc` the top allocation-site diffs. `--trim` calls malloc_trim(0) at each idle point and
records RSS after it: what it gives back is heap fragmentation, not a leak.

    .venv/bin/python -m bench.experiments.memdiag serve --waves 6 --requests 128 --concurrency 64
    MALLOC_ARENA_MAX=2 .venv/bin/python -m bench.experiments.memdiag serve ...
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import omlx_logprobs  # noqa: F401  (before mlx: OpenBLAS)


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def heap() -> dict[str, float]:
    m = LIBC.mallinfo2()
    mib = 2**20
    return {
        "heap_mib": m.arena / mib,  # non-mmapped bytes the arenas hold from the OS
        "in_use_mib": m.uordblks / mib,
        "free_kept_mib": m.fordblks / mib,
        "mmapped_mib": m.hblkhd / mib,
    }


def type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


# ---- client process ------------------------------------------------------------------------------
def body(rng: random.Random, top_max: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": rng.randint(16, 96), "stream": True}
    kw |= rng.choice(
        [
            {"temperature": 0},
            {"temperature": 0.7, "top_p": 0.9, "seed": rng.randint(0, 1 << 30)},
            {"temperature": 1.0, "top_k": 40},
        ]
    )
    if rng.random() < 0.7:
        kw |= {"logprobs": True, "top_logprobs": rng.randint(0, top_max)}
    msg = f"Tell me something about the number {rng.randint(0, 999)}."
    return {"model": "smollm2", "messages": [{"role": "user", "content": msg}], **kw}


async def load(base: str, n: int, concurrency: int, seed: int, top_max: int) -> None:
    import httpx

    rng = random.Random(seed)
    bodies = [body(rng, top_max) for _ in range(n)]
    errors = 0

    async def one(c: httpx.AsyncClient) -> None:
        nonlocal errors
        while bodies:
            b = bodies.pop()
            async with c.stream("POST", "/v1/chat/completions", json=b) as r:
                async for _ in r.aiter_lines():
                    pass
                errors += r.status_code != 200

    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        await asyncio.gather(*[one(c) for _ in range(concurrency)])
    print(json.dumps({"errors": errors}), flush=True)


# ---- server process ------------------------------------------------------------------------------
def wait_idle(engine: Any) -> None:
    while True:
        s = engine.snapshot()
        if s.waiting == s.running == s.cached_sequences == 0:
            return
        time.sleep(0.1)


def drive(args: argparse.Namespace, base: str, engine: Any, server: Any) -> None:
    first: collections.Counter[str] | None = None
    snap0 = None
    for wave in range(args.waves + 1):
        if wave:
            cmd = [
                sys.executable,
                __file__,
                "load",
                "--base",
                base,
                "--n",
                str(args.requests),
                "--concurrency",
                str(args.concurrency),
                "--seed",
                str(wave),
                "--top-max",
                str(args.top_max),
            ]
            subprocess.run(cmd, check=True)
        wait_idle(engine)
        time.sleep(1.0)  # let the connections close and the stream tasks end
        gc.collect()
        s = engine.snapshot()
        counts = type_counts()
        first = first or counts
        row: dict[str, Any] = {
            "wave": wave,
            "requests": wave * args.requests,
            "rss_mib": round(rss_mib(), 1),
            **{k: round(v, 1) for k, v in heap().items()},
            "py_blocks": sys.getallocatedblocks(),
            "gc_objects": sum(counts.values()),
            "mlx_active": s.active_memory,
            "mlx_cache": s.cache_memory,
            "threads": threading.active_count(),
            "cpu_s": round(sum(os.times()[:2]), 1),  # this process, user + system
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            "type_growth": {k: v for k, v in (counts - first).most_common(12)},
        }
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot()
            if snap0 is not None:
                diffs = snap.compare_to(snap0, "lineno")[:10]
                row["tracemalloc"] = [str(d) for d in diffs]
            snap0 = snap0 or snap
        if args.trim:
            LIBC.malloc_trim(0)
            row["rss_after_trim_mib"] = round(rss_mib(), 1)
        print(json.dumps(row), flush=True)
    server.should_exit = True


def serve(args: argparse.Namespace) -> None:
    import socket

    import uvicorn

    from omlx_logprobs.api.app import create_app
    from omlx_logprobs.api.core.served import Served
    from omlx_logprobs.config import EngineConfig
    from omlx_logprobs.engine.engine import Engine
    from omlx_logprobs.models.loader import load_model

    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc)
    sys.setswitchinterval(0.005)
    model = load_model(None, "smollm2", None)
    cfg = EngineConfig(max_num_seqs=args.concurrency, prefill_chunk=512)
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg)
    app = create_app(Served(engine, model, cfg))
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    base = f"http://127.0.0.1:{port}"

    def side() -> None:
        while not server.started:
            time.sleep(0.1)
        try:
            drive(args, base, engine, server)
        finally:
            server.should_exit = True

    threading.Thread(target=side, daemon=True).start()
    server.run()
    os._exit(0)  # as the CLI does: MLX's stream threads abort a normal interpreter exit


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--waves", type=int, default=6)
    s.add_argument("--requests", type=int, default=128)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--top-max", type=int, default=5)
    s.add_argument("--tracemalloc", type=int, default=0, help="frames per trace; 0: off")
    s.add_argument("--trim", action="store_true")
    ld = sub.add_parser("load")
    ld.add_argument("--base", required=True)
    ld.add_argument("--n", type=int, required=True)
    ld.add_argument("--concurrency", type=int, required=True)
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--top-max", type=int, default=5)
    args = p.parse_args()
    if args.cmd == "serve":
        serve(args)
    else:
        asyncio.run(load(args.base, args.n, args.concurrency, args.seed, args.top_max))


if __name__ == "__main__":
    main()
