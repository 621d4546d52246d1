"""The engine in its own process: the outputs that cross match the engine's own (thread mode)
and an independent forward pass; aborts; a child that dies is replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import (
    INITIAL_WEIGHTS,
    AdapterChange,
    Control,
    ControlResult,
    WeightUpdate,
)
from omlx_logprobs.engine.commands import ChangeAdapter, ControlCommand, UpdateWeights
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient
from omlx_logprobs.transport.messages import EngineSpec
from omlx_logprobs.transport.process import ProcessTransport
from omlx_logprobs.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from tests.helpers.engine import Record, collect_outputs, reference_logprobs, run_engine

CFG = EngineConfig(max_num_seqs=16, prefill_chunk=64)


def process_client(tiny_dir: Path, level: str = "warning") -> EngineClient:
    transport = ProcessTransport(EngineSpec(str(tiny_dir), None, CFG, level))
    transport.launch()
    client = EngineClient(transport)
    client.start()
    return client


@pytest.fixture(scope="module")
def proc(tiny_dir: Path) -> Iterator[EngineClient]:
    client = process_client(tiny_dir)
    yield client
    client.shutdown()


def collect(client: EngineClient, reqs: list[EngineRequest]) -> list[Record]:
    """Every choice of every request, rebuilt from its outputs, in submission order."""

    async def main() -> list[list[list[RequestOutput]]]:
        return await asyncio.gather(*[collect_outputs(client, r) for r in reqs])

    return [Record(r, o) for r, outs in zip(reqs, asyncio.run(main())) for o in outs]


@pytest.mark.parametrize("stream", [False, True])
def test_records_match_thread_engine_and_reference(
    proc: EngineClient, tiny: LoadedModel, stream: bool
) -> None:
    """Whether a choice's outputs come as tokens are released or once at its end, what crosses
    is the same."""
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
    ns = [1, 1, 2]  # two choices of the sampled prompt
    reqs = [
        EngineRequest(f"p{i}", p, sp, n, stream=stream)
        for i, (p, sp, n) in enumerate(zip(prompts, params, ns))
    ]
    mine = collect(proc, reqs)
    local = [seq for seq, _ in run_engine(tiny, list(zip(prompts, params)), CFG)]
    assert [r.finish_reason for r in mine] == [FinishReason.LENGTH] * 4
    if not stream:  # one output per choice, at its end
        assert [len(r.outputs) for r in mine] == [1] * 4
    for seq, ref in zip(mine[:3], local):  # thread mode ran no fork; choice 0 is the same
        assert seq.output_ids == ref.output_ids
        for a, b in ((seq.store, ref.store), (seq.prompt_store, ref.prompt_store)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                for x, y in (
                    (a.token_ids, b.token_ids),
                    (a.ranks, b.ranks),
                    (a.top_ids, b.top_ids),
                ):
                    assert list(x) == list(y)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len(mine[3].output_ids) == 9 and mine[3].prompt_store is not None
    assert mine[2].prompt_store is not None
    assert list(mine[3].prompt_store.logprobs) == list(mine[2].prompt_store.logprobs)
    # What crossed against a full forward pass of the prompt and the generated tokens.
    for seq in (mine[0], mine[2]):
        ids = seq.prompt_ids + list(seq.output_ids)
        ref_lp = reference_logprobs(tiny, ids)
        n = len(seq.prompt_ids)
        want = [ref_lp[n - 1 + i, t] for i, t in enumerate(seq.output_ids)]
        assert seq.store is not None
        np.testing.assert_allclose(seq.store.logprobs, want, atol=2e-4)
        if seq.prompt_store is not None:
            pwant = [ref_lp[i - 1, seq.prompt_ids[i]] for i in range(1, n)]
            np.testing.assert_allclose(seq.prompt_store.logprobs, pwant, atol=2e-4)


def test_abort_reaches_the_child(proc: EngineClient) -> None:
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    req = EngineRequest("long", [3, 4, 5], params, stream=True)

    async def main() -> RequestOutput:
        handle = proc.submit(req)
        [slot] = handle.choices
        out = await slot.get()
        handle.abort()
        while not out.finished:
            out = out.merge(await slot.get())
        return out

    out = asyncio.run(main())
    assert out.finish_reason is FinishReason.ABORT
    assert 0 < out.num_tokens < 4000
    deadline = time.time() + 10
    while proc.snapshot().running and time.time() < deadline:
        time.sleep(0.05)
    assert proc.snapshot().aborted_running >= 1 and proc.snapshot().running == 0


def test_commands_cross_the_pipe_and_are_answered(proc: EngineClient, tmp_path: Path) -> None:
    """The records the engine is posted cross as they are; each answer comes back under its
    command's uid, whatever order the engine answers them in."""
    flush = proc.post(ControlCommand(Control("flush")))
    unload = proc.post(ChangeAdapter(AdapterChange("nobody")))
    update = proc.post(UpdateWeights(WeightUpdate(str(tmp_path / "none"))))
    assert flush.result(30) == ControlResult(False)
    assert "nobody" in str(unload.result(30))
    result = update.result(30)
    assert result.version == INITIAL_WEIGHTS and result.error is not None
    assert isinstance(proc.transport, ProcessTransport) and not proc.transport._waiting


def test_an_exit_without_shutdown_ends_the_child(tiny_dir: Path) -> None:
    """The child ignores SIGTERM, which multiprocessing's exit hook sends daemonic children
    before it joins them: an interpreter that exits without `shutdown` closes the child's pipe
    first, and the child stops, rather than the exit waiting on it for ever."""
    code = (
        "import sys; from omlx_logprobs.config import EngineConfig;"
        "from omlx_logprobs.transport.messages import EngineSpec;"
        "from omlx_logprobs.transport.process import ProcessTransport;"
        "t = ProcessTransport(EngineSpec(sys.argv[1], None, EngineConfig(), 'warning'));"
        "t.launch(); print(t.pid, flush=True)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tiny_dir)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert not Path(f"/proc/{int(run.stdout)}").exists()


def test_a_dead_child_fails_its_requests_and_is_replaced(tiny_dir: Path) -> None:
    """Requests in flight fail naming the cause; the child comes back and serves again, and a
    request sent while it was gone waits for it."""
    client = process_client(tiny_dir)
    transport = client.transport
    assert isinstance(transport, ProcessTransport)
    params = SamplingParams(max_tokens=4000, ignore_eos=True)

    async def main() -> tuple[RequestOutput, RequestOutput]:
        handle = client.submit(EngineRequest("doomed", [3, 4, 5], params, stream=True))
        [slot] = handle.choices
        out = await slot.get()
        assert transport.pid is not None
        os.kill(transport.pid, signal.SIGKILL)
        while not out.finished:
            out = out.merge(await slot.get())
        assert client.state == "restarting"
        late = client.submit(EngineRequest("late", [3], SamplingParams(max_tokens=2)))
        [later] = await late.final()
        return out, later

    try:
        out, later = asyncio.run(main())
        assert out.finish_reason is FinishReason.ERROR
        assert "engine process stopped (killed by SIGKILL)" in (out.error or "")
        assert later.finish_reason is FinishReason.LENGTH and later.num_tokens == 2
        assert client.state == "ok"
        assert transport.restarts == 1  # /metrics' omlx_engine_restarts_total
    finally:
        client.shutdown()


def test_a_child_that_cannot_load_fails_launch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    transport = ProcessTransport(EngineSpec(str(tmp_path), None, CFG, "critical"))
    with pytest.raises(RuntimeError, match="failed to start"):
        transport.launch()
