"""Memory per request: once warm, finished requests leave no Python objects behind, and large
MLX buffers go back to the kernel when freed (docs/reliability.md, "Long runs")."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from omlx_logprobs import heap
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.server import TINY_NAME, thread_server, wait_idle
from tests.reliability.client import chat, chat_body

ROUND = 16  # requests per round, all in flight together
FRAMES = 8  # deep enough to reach the package's frame under the stdlib's and the libraries'


@pytest.fixture(scope="module")
def base(tiny_served: LoadedModel) -> Iterator[str]:
    with thread_server(tiny_served, EngineConfig(max_num_seqs=ROUND, prefill_chunk=64)) as (b, _):
        yield b


def body(i: int) -> dict[str, Any]:
    """Chat, streamed and not: logprobs with top 20, a stop string, greedy and sampled."""
    kw: dict[str, Any] = {"max_tokens": 8 + i % 9, "logprobs": True, "top_logprobs": 20}
    kw |= {"stream": i % 2 == 0, "temperature": [0, 0.8][i % 2], "seed": i}
    kw |= {"stop": ["the"]} if i % 3 == 0 else {}
    return chat_body(f"Request {i}: say something about {i * 7}.", **kw)


def completion(i: int) -> dict[str, Any]:
    """A legacy completion that scores its prompt too, with two choices."""
    return {
        "model": TINY_NAME,
        "prompt": f"Score {i} words here",
        "max_tokens": 3 + i % 4,
        "logprobs": 20,
        "echo": True,
        "n": 2,
        "temperature": 1.0,
        "seed": i,
    }


async def one_round(base: str, first: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        chats = [chat(c, body(first + i)) for i in range(ROUND - 4)]
        plain = [c.post("/v1/completions", json=completion(first + i)) for i in range(4)]
        results = await asyncio.gather(*chats, *plain)
    assert all(r.status_code == 200 for r in results[ROUND - 4 :])
    assert all(r.status == 200 and r.error is None for r in results[: ROUND - 4]), [
        (r.status, r.error) for r in results[: ROUND - 4]
    ]


def live() -> Counter[str]:
    """Live objects by type, apart from the prefix cache's entries and what they hold: those
    are bounded by its memory budget, not by requests, and which prompts share a prefix (so
    which entries exist) follows how the scheduler happened to group them."""
    gc.collect()
    objects = gc.get_objects()
    kept: set[int] = set()
    frontier = [o for o in objects if type(o).__qualname__ == "Prefix"]
    for _ in range(4):  # the entry, its __dict__, its lists, their arrays
        kept.update(map(id, frontier))
        frontier = [r for o in frontier for r in gc.get_referents(o) if id(r) not in kept]
    return Counter(type(o).__qualname__ for o in objects if id(o) not in kept)


def servers_own() -> tracemalloc.Snapshot:
    """What the server's code allocated since tracemalloc started and still holds: traces with a
    frame of the package in their stack (this process also runs the test's client, and other
    tests' threads, such as an SDK's event loop, whose stdlib sets grow apart from any request),
    but the prefix cache's: it replaces its entries (new token tuples and index lists, the old
    ones freed untraced), bounded by its budget; a kept sequence's tokens are made by
    runner/snapshot.py (`from_row`)."""
    mine = ("runner/prefix_cache", "runner/prefix", "batch/block_index", "runner/snapshot")
    ours = [tracemalloc.Filter(True, "*/omlx_logprobs/*", all_frames=True)]
    ours += [tracemalloc.Filter(False, f"*/{m}.py", all_frames=True) for m in mine]
    return tracemalloc.take_snapshot().filter_traces(ours)


def outside_the_prefix_cache() -> int:
    return sum(s.size for s in servers_own().statistics("filename"))


def tracemalloc_top() -> list[str]:
    return [str(s) for s in servers_own().statistics("lineno")[:8]]


def test_finished_requests_leave_no_python_objects(base: str) -> None:
    # The same round each time: seeded and greedy requests give the same tokens, so the per-id
    # caches of the formatters (bounded by the vocabulary) are full after the warm-up. The
    # first collection itself has one-off effects (a few dozen weak references rebuilt).
    for _ in range(2):
        asyncio.run(one_round(base, 0))
        wait_idle(base)
        objects = live()
    tracemalloc.start(FRAMES)
    rounds = 3
    try:
        for _ in range(rounds):
            asyncio.run(one_round(base, 0))
        wait_idle(base)
        n = rounds * ROUND
        # The server may still be closing the last connections (protocol objects, transports):
        # those go within moments, a leak stays.
        for _ in range(40):
            grown = live() - objects
            kept = outside_the_prefix_cache()  # bytes allocated since, still live
            if sum(grown.values()) < n // 4 and kept < 1024 * n:
                break
            time.sleep(0.25)
        top = tracemalloc_top()
    finally:
        tracemalloc.stop()
    print(f"\n{n} requests: gc objects {sum(grown.values()):+d}, {kept} bytes kept")
    # Constant per request: not an object per request, under a kilobyte per request (a
    # stored entry list would be kilobytes, the soak's RSS growth was megabytes).
    assert sum(grown.values()) < n // 4, grown.most_common(8)
    assert kept < 1024 * n, "\n".join(top)


PROBE = """
import ctypes, omlx_logprobs
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
libc.free(libc.malloc(16 << 20))  # glibc's own policy: the threshold rises to 16 MiB here
mapped = libc.mallinfo2().hblkhd
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd - mapped)
"""


@pytest.mark.skipif(heap._LIBC is None, reason="glibc only")
def test_large_buffers_keep_their_own_mapping() -> None:
    """After a large block is freed, glibc by default carves blocks up to its size from the heap
    arenas, whose holes stay resident; with the threshold pinned (omlx_logprobs.heap) a new
    large block is mapped on its own, and unmapped when freed. In a fresh process: in this one,
    free heap left by earlier tests could serve the block either way."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 2 << 20  # glibc's own policy: 0, the block is in the heap


FREEZE = """
import gc
from omlx_logprobs import heap
from omlx_logprobs.api.app import create_app  # the server's modules: thousands of objects
before = len(gc.get_objects())
heap.freeze_startup_objects()
print(before, len(gc.get_objects()), gc.get_freeze_count())
"""


def test_startup_objects_are_out_of_the_collectors_sight() -> None:
    """After start-up both processes freeze what they hold: a full collection then walks only
    what serving made (on the GPU host an unfrozen one paused the server ~300 ms). In a fresh
    process, not to freeze this one."""
    out = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, check=True)
    before, after, frozen = map(int, out.stdout.split())
    assert before > 10_000 and frozen >= before // 2 and after < before // 20


@pytest.mark.parametrize("shape", ["chat", "legacy"])
def test_formatting_entries_never_blocks_the_engine_appending(
    tiny_served: LoadedModel, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """The event loop formats an output's entries while the engine thread appends to the store
    they came from. A numpy view of the store's own arrays made the append fail ("cannot resize
    an array that is exporting buffers") and ended the request with an error, once in a few
    thousand under load; an output's block is a copy. Here the append happens exactly inside
    the formatting's finiteness check."""
    store = LogprobStore(2)
    row = np.array([3, 4], np.int32).tobytes(), np.array([-0.5, -1.5], np.float32).tobytes()
    store.append(3, -0.5, 1, *row)
    block = store.block(0, 1)
    real_isfinite = np.isfinite

    def appending(x: Any) -> Any:
        store.append(4, -1.5, 2, *row)  # the engine thread, between two bytecodes
        return real_isfinite(x)

    monkeypatch.setattr(np, "isfinite", appending)
    if shape == "chat":
        text = ChatLogprobFormatter(tiny_served.vocab).entries(block)
    else:
        fmt = LegacyLogprobFormatter(tiny_served.vocab)
        text = fmt.json(LegacyCursor(), 2, None, block)
    assert len(store) > 1 and text.count("-0.5") == 2, text
