"""Sleep and wake in the engine (docs/specs/rl.md, "Sleep and wake"): level 1 releases the prefix
cache and MLX's buffer cache, level 2 the weights too (MLX's active memory falls by their size);
a request that arrives asleep waits; after the wake the same greedy request gives the same
tokens and logprobs, bit for bit."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import Control, ControlResult
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.transport.client import EngineClient
from omlx_logprobs.types import EngineRequest, RequestOutput, SamplingParams
from tests.helpers.engine import client_of, collect_outputs, encode

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)


async def greedy(
    client: EngineClient, rid: str, prompt: list[int]
) -> tuple[list[int], list[float]]:
    outs: list[RequestOutput] = (await collect_outputs(client, EngineRequest(rid, prompt, PARAMS)))[
        0
    ]
    tokens = [t for o in outs for t in o.token_ids.tolist()]
    logprobs = [x for o in outs if o.logprobs is not None for x in o.logprobs.logprobs.tolist()]
    assert all(o.error is None for o in outs) and len(tokens) == 8
    return tokens, logprobs


async def idle(engine: Engine) -> None:
    """Until the engine has released the finished rows and kept the sequence (outputs go out
    before that)."""
    for _ in range(200):
        snap = engine.snapshot()
        if snap.running == 0 and snap.cached_sequences == 0 and snap.prefix_cache_bytes > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the rows not released, or the sequence not kept: {snap}")


def test_sleep_releases_memory_and_wake_serves_the_same_numbers(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir))  # its own: level 2 drops its weights
    engine = Engine(
        model.model, model.vocab, model.eos_token_ids, EngineConfig(prefix_cache_mib=64)
    )
    assert engine.runner.prefixes is not None
    engine.runner.prefixes.min_use = 1  # the short prompt is kept (runner/plan.py's break-even)
    client = client_of(engine)
    prompt = encode(model, "The quick brown fox jumps over the lazy")
    weight_bytes = sum(w.nbytes for _, w in tree_flatten(model.model.parameters()))

    async def main() -> None:
        before = await greedy(client, "r0", prompt)
        await idle(engine)  # the finished sequence is kept

        assert await client.control(Control("sleep", level=1)) == ControlResult(True)
        snap = engine.snapshot()
        assert snap.sleeping == 1 and snap.prefix_cache_bytes == 0 and snap.cache_memory == 0
        held = asyncio.create_task(greedy(client, "r1", prompt))  # waits for the wake
        await asyncio.sleep(0.5)
        assert not held.done() and engine.snapshot().waiting == 0
        assert await client.control(Control("wake")) == ControlResult(False)
        assert await held == before  # the same numbers, not from a kept prefix
        assert engine.snapshot().sleeping == 0

        gc.collect()  # earlier tests' arrays freed now, not between the two measures
        mx.clear_cache()
        active = mx.get_active_memory()
        assert (await client.control(Control("sleep", level=2))).paused
        dropped = engine.snapshot()
        assert dropped.sleeping == 2 and dropped.prefix_cache_bytes == 0
        # The weights' memory went back (a small model: a few MB; allow a tenth of slack).
        assert active - dropped.active_memory > 0.9 * weight_bytes, (active, dropped, weight_bytes)
        assert all(w.size == 0 for _, w in tree_flatten(model.model.parameters()))
        # No path to read them from: an error, and the engine stays asleep.
        failed = await client.control(Control("wake"))
        assert failed.error is not None and "no path" in failed.error
        assert engine.snapshot().sleeping == 2
        assert (await client.control(Control("wake", path=str(tiny_dir)))).error is None
        assert engine.snapshot().active_memory >= active - 0.1 * weight_bytes
        after = await greedy(client, "r2", prompt)
        assert after[0] == before[0]
        np.testing.assert_array_equal(after[1], before[1])

    try:
        asyncio.run(main())
    finally:
        client.shutdown()
