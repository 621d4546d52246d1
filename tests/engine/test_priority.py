"""vLLM's priority scheduling on the engine: with the batch full, a later prompt of higher
priority (a lower value) starts before earlier ones of lower priority, and one that finds no
rows preempts the lowest-priority running choice, which is retracted and prefilled again from
its prompt and output, its tokens and entries those of a run alone (1e-4 of a full forward)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient, RequestHandle
from omlx_logprobs.types import EngineRequest, RequestOutput, SamplingParams
from tests.helpers.engine import Record, check_against_reference, client_of, encode


@pytest.fixture
def client(tiny: LoadedModel) -> Iterator[EngineClient]:
    cfg = EngineConfig(max_num_seqs=2, prefill_chunk=64, prefix_cache_mib=64)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, cfg, tiny.tokenizer)
    c = client_of(engine)
    yield c
    c.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True
    )


class Run:
    """Requests submitted one by one, each output noted in the order the client saw it."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.events: list[tuple[str, bool]] = []  # (request id, finished)
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.reqs: dict[str, EngineRequest] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def submit(self, rid: str, prompt: list[int], n: int, priority: int) -> None:
        req = EngineRequest(rid, prompt, greedy(n), stream=True, priority=priority)
        self.reqs[rid], self.outputs[rid] = req, []
        handle = self.client.submit(req)
        self.tasks.append(asyncio.create_task(self._read(rid, handle)))

    async def _read(self, rid: str, handle: RequestHandle) -> None:
        [slot] = handle.choices
        while True:
            out = await slot.get()
            self.outputs[rid].append(out)
            self.events.append((rid, out.finished))
            if out.finished:
                return

    async def started(self, rid: str) -> None:
        while not self.outputs[rid]:
            await asyncio.sleep(0.001)

    def first(self, rid: str) -> int:
        return next(i for i, (r, _) in enumerate(self.events) if r == rid)

    def end(self, rid: str) -> int:
        return self.events.index((rid, True))

    def record(self, rid: str) -> Record:
        return Record(self.reqs[rid], self.outputs[rid])


def prompts(model: LoadedModel) -> dict[str, list[int]]:
    story = "tell me a story about the sea, the ships that sail on it and their crews. "
    return {k: encode(model, f"Request {k}: {story}") for k in "abcde"}


def test_a_later_higher_priority_prompt_starts_first(
    tiny: LoadedModel, client: EngineClient
) -> None:
    """Two rows taken by priority -5 requests; then priority 5, 0 and 0 arrive: the 0s start
    (in their order) before the 5, though it came first, and nothing running is preempted (all
    of higher priority)."""
    p = prompts(tiny)

    async def main() -> Run:
        run = Run(client)
        run.submit("a", p["a"], 48, -5)
        run.submit("b", p["b"], 48, -5)
        await run.started("a")
        await run.started("b")
        run.submit("c", p["c"], 4, 5)
        run.submit("d", p["d"], 4, 0)
        run.submit("e", p["e"], 4, 0)
        await asyncio.gather(*run.tasks)
        return run

    run = asyncio.run(main())
    assert run.first("d") < run.first("e") < run.first("c")
    assert run.end("a") < run.first("d") and run.end("b") < run.first("d")  # never preempted
    for rid in "abcde":
        r = run.record(rid)
        assert r.error is None and r.num_output == run.reqs[rid].params.max_tokens
        check_against_reference(tiny, p[rid], r, 2)


def test_a_higher_priority_prompt_preempts_the_lowest_running(
    tiny: LoadedModel, client: EngineClient
) -> None:
    """Rows taken by priorities 1 and 3; a priority 0 request arrives: the 3 is preempted, the
    new one runs at once and finishes first; the preempted one resumes once its row is free,
    its tokens and entries those of a request that was never interrupted."""
    p = prompts(tiny)

    async def main() -> Run:
        run = Run(client)
        run.submit("a", p["a"], 64, 1)
        run.submit("b", p["b"], 64, 3)
        await run.started("a")
        await run.started("b")
        run.submit("c", p["c"], 6, 0)
        await asyncio.gather(*run.tasks)
        return run

    run = asyncio.run(main())
    assert run.end("c") < run.end("a") < run.end("b")
    # b had no output while c ran: it waited for c's row (a's went on)
    between = {r for r, _ in run.events[run.first("c") : run.end("c")]}
    assert between == {"a", "c"}
    for rid in "abc":
        r = run.record(rid)
        assert r.error is None and r.num_output == run.reqs[rid].params.max_tokens
        check_against_reference(tiny, p[rid], r, 2)
    # b's prefill again from its prompt and output came from the cache (its kept keys)
    assert run.outputs["b"][-1].cached_tokens > len(p["b"])
