"""200 abrupt disconnects (TCP reset) under load, mid-prefill, mid-stream and mid-answer, against a
real server process with the prefix cache on. Afterwards nothing is queued, running or held in a
row; MLX holds what it held before beside what the prefix cache keeps, and once that is flushed,
exactly what it held before; resident memory is near its baseline, and the same request gives
the same answer."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.server import ServerProcess, server_process, wait_idle
from tests.reliability.client import ChatResult, chat, chat_body

DISCONNECTS = 200
AT_ONCE = 20
LONG_PROMPT = "Count the words in this text. " + "alpha beta gamma delta " * 150  # ~600 tokens


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--max-num-seqs", "32"]
    # The prefix cache keeps what aborted requests computed (bounded by its budget; its
    # eviction is tested in tests/engine/); a flush lets it all go.
    args += ["--prefill-chunk", "16", "--log-level", "warning", "--prefix-cache-mib", "64"]
    with server_process(args, tmp_path_factory.mktemp("disc")) as s:
        yield s


def body(i: int) -> bytes:
    kind = i % 3
    b = chat_body(
        LONG_PROMPT if kind == 0 else f"Story {i}",
        max_tokens=400,
        ignore_eos=True,
        stream=kind == 1,
        logprobs=bool(i % 2),
        top_logprobs=i % 4 if i % 2 else None,
    )
    return httpx.Request("POST", "http://x", json=b).content


async def abrupt(port: int, i: int, rng: random.Random) -> None:
    """Send request i, then reset the connection: during prefill (long prompt), after the first
    streamed tokens, or part-way through a plain answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = body(i)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    await writer.drain()
    if i % 3 == 1:
        seen = b""
        while seen.count(b"data: ") < 3:  # the role chunk, then two chunks of tokens
            seen += await asyncio.wait_for(reader.read(4096), 60)
    else:
        await asyncio.sleep(rng.uniform(0.02, 0.25))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # RST: no FIN, no goodbye


async def load(base: str, stop: asyncio.Event, want: dict[int, ChatResult]) -> int:
    """Well-behaved streams running throughout; each must equal its answer given alone."""
    done = 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        while not stop.is_set():
            k = done % len(want)
            got = await chat(c, steady(k))
            assert got.token_ids == want[k].token_ids and got.text == want[k].text
            assert got.aligned
            done += 1
    return done


def steady(k: int) -> dict[str, Any]:
    return chat_body(
        f"Steady {k}",
        max_tokens=16,
        temperature=0,
        ignore_eos=True,
        stream=True,
        logprobs=True,
        top_logprobs=2,
    )


async def storm(server: ServerProcess, want: dict[int, ChatResult], n: int) -> int:
    port = int(server.base.rsplit(":", 1)[1])
    stop = asyncio.Event()
    workers = [asyncio.ensure_future(load(server.base, stop, want)) for _ in range(6)]
    rng = random.Random(6)
    for start in range(0, n, AT_ONCE):
        await asyncio.gather(*[abrupt(port, i, rng) for i in range(start, start + AT_ONCE)])
    stop.set()
    return sum(await asyncio.gather(*workers))


def flushed(base: str) -> dict[str, Any]:
    """/health's engine block once idle with the prefix cache emptied."""
    assert httpx.post(base + "/flush_cache", timeout=30).status_code == 200
    stats = wait_idle(base)
    assert stats["prefix_cache_bytes"] == 0
    return stats


async def alone(base: str, bodies: list[dict[str, Any]]) -> list[ChatResult]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        return [await chat(c, b) for b in bodies]


def test_200_abrupt_disconnects_under_load(server: ServerProcess) -> None:
    want = dict(enumerate(asyncio.run(alone(server.base, [steady(k) for k in range(4)]))))
    asyncio.run(storm(server, want, 60))  # warm-up: allocator pools, code paths
    before = flushed(server.base)
    rss_before = server.rss()

    served = asyncio.run(storm(server, want, DISCONNECTS))
    after = wait_idle(server.base)
    rss_after = server.rss()
    kept = after["prefix_cache_bytes"]
    # MLX's buffer cache hands an array a freed buffer up to two pages larger than it asks for
    # (BufferCache::reuse_from_cache): the kept sequences' arrays hold a little more than
    # their count, and give it back with them (the flush below).
    slack = after["active_memory"] - before["active_memory"] - kept
    emptied = flushed(server.base)
    print(
        f"\nserved {served} streams meanwhile; before {before}; after {after}; "
        f"prefix cache {kept} bytes, {slack} beyond them; flushed {emptied['active_memory']}; "
        f"rss {rss_before >> 20} -> {rss_after >> 20} MiB"
    )
    assert after["waiting"] == after["running"] == after["cached_sequences"] == 0
    assert 0 < kept <= 64 << 20 and 0 <= slack < kept // 8
    aborted_waiting = after["aborted_waiting"] - before["aborted_waiting"]
    aborted_running = after["aborted_running"] - before["aborted_running"]
    # Every disconnect aborted a live request (none ran to its end), in both phases.
    assert aborted_waiting + aborted_running == DISCONNECTS
    assert aborted_waiting >= 20 and aborted_running >= 20, (aborted_waiting, aborted_running)
    # Every KV cache row was freed, and nothing stays beside the prefix cache: one row of the
    # tiny model's cache is at least 8 KiB. One run under load read 4 bytes more before than
    # after (a scalar some step left alive).
    assert abs(emptied["active_memory"] - before["active_memory"]) < 1024
    assert rss_after - rss_before < 64 << 20
    assert served > 0
    again = asyncio.run(alone(server.base, [steady(k) for k in range(4)]))
    assert [r.token_ids for r in again] == [want[k].token_ids for k in range(4)]
