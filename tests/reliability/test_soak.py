"""Soak (slow; `make soak`): 64 concurrent streams on the embedded model for SOAK_SECONDS (default
120) against a real server process. Zero errors, every answer and every chunk aligned, resident
memory flat after the warm-up (the first half), and afterwards nothing running and MLX holding
what it held before."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers.server import MODEL_NAME, ServerProcess, server_process, wait_idle
from tests.reliability.client import ChatResult, chat, chat_body

STREAMS = 64


def request(rng: random.Random, kind: int | None = None) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": rng.randint(16, 96), "stream": True}
    kw |= [
        {"temperature": 0},
        {"temperature": 0.7, "top_p": 0.9, "seed": rng.randint(0, 1 << 30)},
        {"temperature": 1.0, "top_k": 40},
    ][rng.randrange(3) if kind is None else kind]
    if rng.random() < 0.7:
        kw |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
    return {
        **chat_body(f"Tell me something about the number {rng.randint(0, 999)}.", **kw),
        "model": MODEL_NAME,
    }


@dataclass
class Soak:
    done: int = 0
    errors: list[str] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (s, RSS, MLX cache)
    start: float = field(default_factory=time.time)


async def worker(base: str, seed: int, until: float, soak: Soak) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        while time.time() < until:
            try:
                r: ChatResult = await chat(c, request(rng))
            except httpx.HTTPError as e:
                soak.errors.append(f"{type(e).__name__}: {e}")
                continue
            # Aligned: the whole answer and every chunk on its own.
            if r.status != 200 or r.error is not None or not r.aligned:
                soak.errors.append(f"{r.status} {r.error} aligned={r.aligned}")
            soak.done += 1


async def warm_up(base: str) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        for kind in range(3):
            assert (await chat(c, {**request(rng, kind), "max_tokens": 4})).status == 200


async def sample_memory(server: ServerProcess, until: float, soak: Soak) -> None:
    async with httpx.AsyncClient(base_url=server.base, timeout=60) as c:
        while time.time() < until:
            cache = (await c.get("/health")).json()["engine"]["cache_memory"]
            soak.samples.append((time.time() - soak.start, server.rss(), cache))
            await asyncio.sleep(5)


async def run(server: ServerProcess, seconds: float) -> Soak:
    until = time.time() + seconds
    soak = Soak()
    sampler = asyncio.ensure_future(sample_memory(server, until, soak))
    await asyncio.gather(*[worker(server.base, s, until, soak) for s in range(STREAMS)])
    await sampler
    return soak


@pytest.mark.slow
def test_soak(embedded_dir: Path, tmp_path: Path) -> None:
    seconds = float(os.environ.get("SOAK_SECONDS", "120"))
    with server_process(["--max-num-seqs", str(STREAMS), "--log-level", "warning"], tmp_path) as s:
        asyncio.run(warm_up(s.base))  # MLX allocates its global PRNG key on first use
        before = wait_idle(s.base)
        soak = asyncio.run(run(s, seconds))
        after = wait_idle(s.base)
    # Warm-up: the first half of the run, by which the batch is full and the KV caches have
    # their working lengths. After it, RSS moves with the batch's lengths (tens of MiB either
    # way), so flatness is the least-squares trend over the second half, not max minus first.
    warm = seconds / 2
    settled = [(t, rss) for t, rss, _ in soak.samples if t >= warm]
    assert len(settled) >= 6, "too short to see memory after the warm-up: raise SOAK_SECONDS"
    ts, rss = np.array(settled, dtype=float).T
    slope = float(np.polyfit(ts, rss, 1)[0])  # bytes per second
    growth = slope * (ts[-1] - ts[0]) / 2**20
    print(
        f"\nsoak: {STREAMS} streams x {seconds:.0f} s: {soak.done} requests, "
        f"{len(soak.errors)} errors (misaligned answers or chunks included); "
        f"(s, RSS MiB, MLX cache MiB): {[(round(t), m >> 20, c >> 20) for t, m, c in soak.samples]}"
        f"; RSS trend over the last {ts[-1] - ts[0]:.0f} s: {growth:+.0f} MiB "
        f"({slope * 60 / 2**20:+.1f} MiB/min); MLX active memory "
        f"{before['active_memory']} -> {after['active_memory']}"
    )
    assert not soak.errors, soak.errors[:5]
    assert after["running"] == after["waiting"] == after["cached_sequences"] == 0
    assert after["active_memory"] == before["active_memory"]
    assert growth < 64, growth
