"""Soak (slow; `make soak`): 64 concurrent streams on the embedded model for SOAK_SECONDS (default
120) against a real server process. Zero errors, every answer aligned, resident memory flat after
warm-up, and afterwards nothing running and MLX holding what it held before."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import MODEL_NAME
from tests.reliability.client import ChatResult, chat, chat_body
from tests.reliability.conftest import ServerProcess, server_process, wait_idle

STREAMS = 64
WARM_UP_S = 30


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


async def worker(base: str, seed: int, until: float, errors: list[str]) -> int:
    rng = random.Random(seed)
    done = 0
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        while time.time() < until:
            body = request(rng)
            try:
                r: ChatResult = await chat(c, body)
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if r.status != 200 or r.error is not None or not r.chunks_aligned:
                errors.append(f"{r.status} {r.error} aligned={r.chunks_aligned}")
            done += 1
    return done


async def warm_up(base: str) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        for kind in range(3):
            assert (await chat(c, {**request(rng, kind), "max_tokens": 4})).status == 200


async def sample_rss(server: ServerProcess, until: float, out: list[tuple[float, int]]) -> None:
    start = time.time()
    while time.time() < until:
        out.append((time.time() - start, server.rss()))
        await asyncio.sleep(5)


async def soak(server: ServerProcess, seconds: float) -> tuple[int, list[str], list]:
    until = time.time() + seconds
    errors: list[str] = []
    rss: list[tuple[float, int]] = []
    sampler = asyncio.ensure_future(sample_rss(server, until, rss))
    done = await asyncio.gather(*[worker(server.base, s, until, errors) for s in range(STREAMS)])
    await sampler
    return sum(done), errors, rss


@pytest.mark.slow
def test_soak(embedded_dir: Path, tmp_path: Path) -> None:
    seconds = float(os.environ.get("SOAK_SECONDS", "120"))
    with server_process(["--max-num-seqs", str(STREAMS), "--log-level", "warning"], tmp_path) as s:
        asyncio.run(warm_up(s.base))  # MLX allocates its global PRNG key on first use
        before = wait_idle(s.base)
        done, errors, rss = asyncio.run(soak(s, seconds))
        after = wait_idle(s.base)
    settled = [m for t, m in rss if t >= WARM_UP_S]
    growth = (max(settled) - settled[0]) >> 20 if settled else 0
    print(
        f"\nsoak: {STREAMS} streams x {seconds:.0f} s: {done} requests, {len(errors)} errors; "
        f"RSS MiB over time {[(round(t), m >> 20) for t, m in rss]}; growth after warm-up "
        f"{growth} MiB; active memory {before['active_memory']} -> {after['active_memory']}"
    )
    assert not errors, errors[:5]
    assert after["running"] == after["waiting"] == after["cached_sequences"] == 0
    assert after["active_memory"] == before["active_memory"]
    assert growth < 64, growth
