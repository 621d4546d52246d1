"""The engine in its own process: the server's copies of the requests' records match the
engine's own (thread mode) and an independent forward pass; aborts; a child that dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.process import PROGRESS_EVERY, EngineProcess, EngineSpec
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import FinishReason, RequestOutput, SamplingParams
from tests.helpers.engine import reference_logprobs, run_engine

CFG = EngineConfig(max_num_seqs=16, prefill_chunk=64)


@pytest.fixture(scope="module")
def proc(tiny_dir: Path) -> Iterator[EngineProcess]:
    engine = EngineProcess(EngineSpec(str(tiny_dir), None, CFG, "warning"))
    engine.launch()
    engine.start()
    yield engine
    engine.shutdown()


def collect(engine: EngineProcess, seqs: list[Sequence], final_only: bool) -> list[RequestOutput]:
    """Every choice's outputs merged, in submission order."""

    async def one(seq: Sequence) -> list[RequestOutput]:
        handles = engine.add_group(seq, asyncio.get_running_loop(), final_only)
        outs = []
        for h in handles:
            out = await h.collector.get()
            while not out.finished:
                out = out.merge(await h.collector.get())
            outs.append(out)
        return outs

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[one(s) for s in seqs])

    return [o for outs in asyncio.run(main()) for o in outs]


def test_store_rows_cross_once() -> None:
    src, dst = LogprobStore(2), LogprobStore(2)
    for i in range(5):
        src.append(i, -0.5 * i, i, np.array([7, 8], np.int32).tobytes(), b"\0" * 8)
    dst.put(src.rows(0))
    dst.put(src.rows(3))  # a resend of positions it has adds nothing
    src.append(9, -9.0, 4, np.array([1, 2], np.int32).tobytes(), b"\0" * 8)
    dst.put(src.rows(4))  # overlapping: only position 5 is new
    assert list(dst.token_ids) == list(src.token_ids) == [0, 1, 2, 3, 4, 9]
    assert dst.logprobs == src.logprobs and dst.top_ids == src.top_ids
    with pytest.raises(ValueError):
        LogprobStore(2).put(src.rows(2))  # a gap is a bug, never silently skipped


@pytest.mark.parametrize("final_only", [False, True])
def test_records_match_thread_engine_and_reference(
    proc: EngineProcess, tiny: LoadedModel, final_only: bool
) -> None:
    prompts = [[1, 17, 250, 9, 33], [5, 6, 7], list(range(40, 70))]
    params = [
        SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5
        ),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, prompt_logprobs=3),
        SamplingParams(
            max_tokens=9,
            temperature=0.9,
            seed=3,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=2,
            prompt_logprobs=1,
        ),
    ]
    seqs = [Sequence(f"p{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    seqs[2].fork(1)  # two choices of the sampled prompt
    outs = collect(proc, seqs, final_only)
    local = [seq for seq, _ in run_engine(tiny, list(zip(prompts, params)), CFG)]
    mine = [seqs[0], seqs[1], *seqs[2].group]
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH] * 4
    for seq, ref in zip(mine[:3], local):  # thread mode ran no fork; choice 0 is the same
        assert seq.output_ids == ref.output_ids
        for a, b in ((seq.store, ref.store), (seq.prompt_store, ref.prompt_store)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.token_ids, a.ranks, a.top_ids) == (b.token_ids, b.ranks, b.top_ids)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len(mine[3].output_ids) == 9 and mine[3].prompt_store is mine[2].prompt_store
    # The server's copies against a full forward pass of the prompt and the generated tokens.
    for seq in (seqs[0], seqs[2]):
        ids = seq.prompt_ids + list(seq.output_ids)
        ref_lp = reference_logprobs(tiny, ids)
        n = len(seq.prompt_ids)
        want = [ref_lp[n - 1 + i, t] for i, t in enumerate(seq.output_ids)]
        assert seq.store is not None
        np.testing.assert_allclose(seq.store.logprobs, want, atol=2e-4)
        if seq.prompt_store is not None:
            pwant = [ref_lp[i - 1, seq.prompt_ids[i]] for i in range(1, n)]
            np.testing.assert_allclose(seq.prompt_store.logprobs, pwant, atol=2e-4)


def test_a_non_streamed_request_ships_its_records_early(
    proc: EngineProcess, tiny: LoadedModel
) -> None:
    """With `on_progress`, a final-only request's records arrive every PROGRESS_EVERY tokens
    (at a phase set by its id) and one token before max_tokens (the consumer is not woken: one
    output, at the end), each arrival sees the records grown, and they end equal to the thread
    engine's."""
    params = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    seq = Sequence("early", [1, 17, 250, 9], params)
    seen: list[int] = []

    async def main() -> list[RequestOutput]:
        loop = asyncio.get_running_loop()
        handle = proc.add_request(seq, loop, True, lambda: seen.append(seq.num_output))
        outs = [await handle.collector.get()]
        while not outs[-1].finished:
            outs.append(await handle.collector.get())
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 1 and (outs[0].first_token, outs[0].end_token) == (0, 40)
    # every PROGRESS_EVERY tokens at the request's own phase, then one token before the end
    phase = -seq.seq_id % PROGRESS_EVERY or PROGRESS_EVERY
    assert seen == [*range(phase, 39, PROGRESS_EVERY), 39]
    [(ref, _)] = run_engine(tiny, [(seq.prompt_ids, params)], CFG)
    assert seq.output_ids == ref.output_ids
    assert seq.store is not None and ref.store is not None
    assert (seq.store.token_ids, seq.store.top_ids) == (ref.store.token_ids, ref.store.top_ids)
    # ... and the shipped logprobs against a full forward pass
    n = len(seq.prompt_ids)
    ref_lp = reference_logprobs(tiny, seq.prompt_ids + list(seq.output_ids))
    want = [ref_lp[n - 1 + i, t] for i, t in enumerate(seq.output_ids)]
    np.testing.assert_allclose(seq.store.logprobs, want, atol=2e-4)


def test_abort_reaches_the_child(proc: EngineProcess) -> None:
    seq = Sequence("long", [3, 4, 5], SamplingParams(max_tokens=4000, ignore_eos=True))

    async def main() -> RequestOutput:
        handle = proc.add_request(seq, asyncio.get_running_loop())
        out = await handle.collector.get()
        proc.abort(seq)
        while not out.finished:
            out = out.merge(await handle.collector.get())
        return out

    out = asyncio.run(main())
    assert out.finish_reason is FinishReason.ABORT and seq.finish_reason is FinishReason.ABORT
    assert 0 < out.end_token < 4000
    deadline = time.time() + 10
    while proc.snapshot().running and time.time() < deadline:
        time.sleep(0.05)
    assert proc.snapshot().aborted_running >= 1 and proc.snapshot().running == 0


def test_a_dead_child_fails_its_requests(tiny_dir: Path) -> None:
    engine = EngineProcess(EngineSpec(str(tiny_dir), None, CFG, "warning"))
    engine.launch()
    engine.start()
    seq = Sequence("doomed", [3, 4, 5], SamplingParams(max_tokens=4000, ignore_eos=True))

    async def main() -> RequestOutput:
        handle = engine.add_request(seq, asyncio.get_running_loop())
        out = await handle.collector.get()
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        while not out.finished:
            out = out.merge(await handle.collector.get())
        return out

    try:
        out = asyncio.run(main())
        assert out.finish_reason is FinishReason.ERROR and "engine process" in (out.error or "")
        assert not engine.alive
        late = Sequence("late", [3], SamplingParams(max_tokens=2))
        assert collect(engine, [late], True)[0].finish_reason is FinishReason.ERROR
    finally:
        engine.shutdown()


def test_a_child_that_cannot_load_fails_launch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    engine = EngineProcess(EngineSpec(str(tmp_path), None, CFG, "critical"))
    with pytest.raises(RuntimeError, match="failed to start"):
        engine.launch()
