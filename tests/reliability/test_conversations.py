"""Soak of multi-turn conversations (slow; `make soak`): CONVERSATIONS (default 1,000) of 3 to 6
turns, 16 at a time, half through the Responses API (each turn continuing the last by
`previous_response_id`), half through chat (the whole conversation resent), against a real server
process with a small prefix cache (4 MiB). The prefix cache stays within its budget throughout
and serves the turns' earlier parts; the Responses store keeps at most its 256 responses, the
most recent of them; and once the prefix cache is flushed, MLX holds exactly what it held after
the warm-up, with the processes' resident memory back near its baseline."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers.server import ServerProcess, server_process, wait_idle

pytestmark = pytest.mark.slow

CONVERSATIONS = int(os.environ.get("CONVERSATIONS", "1000"))
AT_ONCE = 16
CACHE_MIB = 4
STORED = 256  # the Responses store's count (api/responses/store.py)
WARM_UP = max(CONVERSATIONS // 10, 32)


@dataclass
class Soak:
    turns: int = 0
    continued: int = 0  # turns after a conversation's first
    cached: int = 0  # ... that started from the prefix cache
    response_ids: list[str] = field(default_factory=list)
    cache_bytes: list[int] = field(default_factory=list)  # /health's, sampled
    rss: list[int] = field(default_factory=list)


def rss(server: ServerProcess) -> int:
    """The server's resident memory and its engine process's."""
    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


async def responses(c: httpx.AsyncClient, rng: random.Random, i: int, soak: Soak) -> None:
    previous = None
    for turn in range(rng.randint(3, 6)):
        text = f"Conversation {i}, turn {turn}: go on."
        body: dict[str, Any] = {"model": "tiny", "input": text, "temperature": 0,
                                "max_output_tokens": rng.randint(8, 32)}  # fmt: skip
        if previous is not None:
            body["previous_response_id"] = previous
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["status"] in ("completed", "incomplete"), got
        previous = got["id"]
        soak.response_ids.append(previous)
        count(soak, turn, got["usage"]["input_tokens_details"]["cached_tokens"])


async def chat(c: httpx.AsyncClient, rng: random.Random, i: int, soak: Soak) -> None:
    messages = [{"role": "system", "content": f"You are assistant number {i % 7}."}]
    for turn in range(rng.randint(3, 6)):
        messages.append({"role": "user", "content": f"Conversation {i}, turn {turn}: go on."})
        body = {"model": "tiny", "messages": messages, "max_tokens": rng.randint(8, 32),
                "temperature": 0}  # fmt: skip
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
        count(soak, turn, got["usage"]["prompt_tokens_details"]["cached_tokens"])


def count(soak: Soak, turn: int, cached: int) -> None:
    soak.turns += 1
    if turn:
        soak.continued += 1
        soak.cached += cached > 0


async def conversations(base: str, first: int, n: int, soak: Soak) -> None:
    queue = list(range(first, first + n))

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            while queue:
                i = queue.pop(0)
                await (responses if i % 2 else chat)(c, rng, i, soak)

    async def sample(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            while not done.is_set():
                soak.cache_bytes.append(
                    (await c.get("/health")).json()["engine"]["prefix_cache_bytes"]
                )
                await asyncio.sleep(1)

    done = asyncio.Event()
    sampler = asyncio.ensure_future(sample(done))
    await asyncio.gather(*[worker(first * 1000 + s) for s in range(AT_ONCE)])
    done.set()
    await sampler


def flushed(server: ServerProcess) -> dict[str, Any]:
    assert httpx.post(server.base + "/flush_cache", timeout=30).status_code == 200
    time.sleep(1)  # the engine's idle turn: glibc trims what was freed (omlx_logprobs.heap)
    return wait_idle(server.base)


async def stored(base: str, ids: list[str]) -> list[bool]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        return [(await c.get(f"/v1/responses/{i}")).status_code == 200 for i in ids]


def test_conversations(tiny_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "warning",
            "--max-num-seqs", str(AT_ONCE), "--prefix-cache-mib", str(CACHE_MIB)]  # fmt: skip
    with server_process(args, tmp_path) as server:
        warm = Soak()
        asyncio.run(conversations(server.base, 0, WARM_UP, warm))
        before, rss_before = flushed(server), rss(server)
        soak = Soak()
        t0 = time.monotonic()
        asyncio.run(conversations(server.base, WARM_UP, CONVERSATIONS, soak))
        seconds = time.monotonic() - t0
        busy = wait_idle(server.base)
        ids = warm.response_ids + soak.response_ids
        kept = asyncio.run(stored(server.base, ids))
        after, rss_after = flushed(server), rss(server)
    print(f"\n{CONVERSATIONS} conversations, {soak.turns} turns in {seconds:.0f} s; "
          f"{soak.cached} of {soak.continued} later turns from the prefix cache; its bytes at "
          f"most {max(soak.cache_bytes)} (budget {CACHE_MIB << 20}), {busy['prefix_cache_bytes']}"
          f" at the end; {sum(kept)} of {len(ids)} responses stored; MLX active "
          f"{before['active_memory']} -> {after['active_memory']} once flushed; RSS "
          f"{rss_before >> 20} -> {rss_after >> 20} MiB")  # fmt: skip
    assert max(soak.cache_bytes) <= CACHE_MIB << 20
    assert soak.cached > soak.continued // 2
    # The store's count, the most recent ones (each continuation used, and so refreshed, the
    # response before it: the last ones made are those kept).
    assert sum(kept) == STORED and all(kept[-STORED // 2 :])
    assert after["active_memory"] == before["active_memory"]
    assert rss_after - rss_before < 32 << 20
