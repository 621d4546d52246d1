"""Training calls in the engine (engine/trainings.py): a forward_backward's datums go in padded
forwards of as many as the step's token bound takes, answered in order with each datum's
numbers alone; datums that do not fit in the memory free beside the batch wait until the
requests running have finished (none lost), and with no request to free any, the call fails
saying what it needed while the engine serves on."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.commands import Train
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.engine.trainings import admitted
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.training.calls import BatchPass, CreateRun, DatumPass, LoraSpec, TrainAnswer
from omlx_logprobs.types import EngineRequest, SamplingParams
from tests.helpers.engine import client_of, collect_outputs


def datum(n: int, seed: int) -> DatumPass:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 40000, n + 1).astype(np.int32)
    inputs = {"target_tokens": tokens[1:], "weights": np.ones(n, np.float32)}
    return DatumPass("run", tokens[:-1], inputs, "cross_entropy")


def test_admitted_counts_rows_times_the_longest() -> None:
    d = [datum(n, i) for i, n in enumerate((10, 4, 12, 3))]
    assert admitted(d, 30, 1 << 40, 1) == 2  # 2 x 10; 3 x 12 = 36 is past 30
    assert admitted(d, 5, 1 << 40, 1) == 1  # one datum always, whatever its length
    assert admitted(d, 100, 24 * 8, 8) == 2  # memory: 2 x 10 x 8 bytes fit, 3 x 12 x 8 not
    assert admitted(d, 100, 79, 8) == 0  # not even the first
    assert admitted(d[3:], 100, 1 << 40, 0) == 1


@pytest.fixture
def engine(tiny_dir: Path) -> Engine:
    model = load_model(str(tiny_dir))  # its own: a run adapts its layers
    return Engine(model.model, model.vocab, model.eos_token_ids, EngineConfig())


def train(engine: Engine, call: object) -> Future[TrainAnswer]:
    return engine.post(Train(call))  # type: ignore[arg-type]


def test_datums_go_in_padded_forwards_within_the_token_bound(engine: Engine) -> None:
    client = client_of(engine)
    try:
        assert train(engine, CreateRun("run", LoraSpec(4, seed=3))).result(60).error is None
        data = tuple(datum(n, i) for i, n in enumerate((10, 10, 6, 10, 10)))
        engine.trainings.tokens = 25
        got = train(engine, BatchPass(data, token_bytes=1)).result(120)
        assert got.error is None, got.error
        assert engine.trainings.forwards == 3  # 2 + 2 + 1
        alone = [train(engine, d).result(60).value for d in data]
        for a, b in zip(alone, got.value):
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
    finally:
        client.shutdown()


def test_datums_wait_for_the_memory_running_requests_hold(engine: Engine) -> None:
    """Memory as the engine sees it, made scarce while a request runs: the forward waits for
    the request to finish (it is served whole), then runs."""
    free = 1 << 30
    engine.trainings.memory = lambda: 0 if engine.scheduler.running else free
    client = client_of(engine)
    ran_with: list[int] = []
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def main() -> None:
        assert train(engine, CreateRun("run", LoraSpec(4, seed=3))).result(60).error is None
        request = asyncio.ensure_future(
            collect_outputs(client, EngineRequest("r", [5] * 8, params))
        )
        while not engine.scheduler.running:
            await asyncio.sleep(0.005)
        done = train(engine, BatchPass((datum(8, 1), datum(5, 2)), token_bytes=1024))
        done.add_done_callback(lambda _: ran_with.append(len(engine.scheduler.running)))
        outs = (await request)[0]
        got = await asyncio.wrap_future(done)
        assert got.error is None and len(got.value) == 2
        assert sum(len(o.token_ids) for o in outs) == 24 and outs[-1].error is None
        assert ran_with == [0]  # trained once the request had finished

    try:
        asyncio.run(main())
        # idle, nothing will free memory: too large a datum fails, saying what it needed
        free = 1000
        got = train(engine, BatchPass((datum(8, 1),), token_bytes=1024)).result(60)
        assert got.user and got.error is not None and "needs about" in got.error
        assert engine.trainings.forwards == 1
        free = 1 << 30
        assert train(engine, BatchPass((datum(8, 1),), token_bytes=1024)).result(60).error is None
    finally:
        client.shutdown()
