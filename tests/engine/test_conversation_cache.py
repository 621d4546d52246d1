"""A conversation resent turn after turn: each turn starts from what the last one computed (its
prompt and its answer, kept when it finished), short prompts and prompts in chunks alike, and
gives the same tokens and logprobs as an engine with the cache off (1e-4, float32 on the CPU),
with `cached_tokens` exactly the tokens taken from the cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import EngineRequest, RequestOutput, SamplingParams
from tests.helpers.engine import (
    Record,
    check_against_reference,
    client_of,
    collect_outputs,
    encode,
)


class Chat:
    """One engine that requests are sent to in turns, as a server's clients send them."""

    def __init__(self, model: LoadedModel, cfg: EngineConfig) -> None:
        engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, model.tokenizer)
        self.engine, self.client, self.sent = engine, client_of(engine), 0

    def send(self, prompts: list[list[int]], params: SamplingParams) -> list[Record]:
        reqs = [
            EngineRequest(f"t{self.sent}-{i}", list(p), params, stream=True)
            for i, p in enumerate(prompts)
        ]
        self.sent += 1

        async def main() -> list[list[list[RequestOutput]]]:
            return await asyncio.gather(*[collect_outputs(self.client, r) for r in reqs])

        return [Record(r, o[0]) for r, o in zip(reqs, asyncio.run(main()))]


@pytest.fixture
def chats(tiny: LoadedModel) -> Iterator[tuple[Chat, Chat]]:
    """The same small chunk size with the cache on and off: prompts past 64 tokens prefill in
    chunks."""
    on = Chat(tiny, EngineConfig(prefill_chunk=64, prefix_cache_mib=64))
    off = Chat(tiny, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    yield on, off
    on.client.shutdown()
    off.client.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
    )


def cached(r: Record) -> int:
    return r.outputs[-1].cached_tokens


@pytest.mark.parametrize("system_words", [3, 40], ids=["short", "chunked"])
def test_each_turn_starts_from_the_last(
    tiny: LoadedModel, chats: tuple[Chat, Chat], system_words: int
) -> None:
    """Four turns, each the last turn's prompt, its answer and a new user message: from the
    second on, every token the conversation had but its last comes from the cache; answers and
    every entry equal the cache-off engine's and a full forward pass."""
    on, off = chats
    prompt = encode(tiny, "You are a terse assistant. " * system_words + "User: hello\n")
    last_len = 0  # the tokens the last turn had: its prompt and answer
    for turn in range(4):
        [r] = on.send([prompt], greedy(12))
        [ref] = off.send([prompt], greedy(12))
        assert list(r.output_ids) == list(ref.output_ids) and cached(ref) == 0
        assert r.store is not None and ref.store is not None
        np.testing.assert_allclose(r.store.logprobs, ref.store.logprobs, atol=1e-4)
        check_against_reference(tiny, prompt, r, 3)
        # All of them but the answer's last token, which is not kept (it may not have been fed).
        assert cached(r) == (last_len - 1 if turn else 0)
        last_len = len(prompt) + len(r.output_ids)
        prompt = prompt + list(r.output_ids) + encode(tiny, f"\nUser: and {turn}?\n")


def test_concurrent_rows_and_a_parted_conversation(
    tiny: LoadedModel, chats: tuple[Chat, Chat]
) -> None:
    """Three conversations on one system turn, sent together; then each goes on, and a fourth
    parts from the first halfway through its answer: each takes the longest start it shares
    with what is kept. Answers of 24 tokens: starts of one step closer than MIN_TOKENS would
    share their common start (PrefixCache.assign)."""
    on, off = chats
    system = encode(tiny, "System: answer briefly and politely, always. " * 4)
    firsts = [system + encode(tiny, f"User: question number {i}\n") for i in range(3)]
    rs = on.send(firsts, greedy(24))
    off.send(firsts, greedy(24))
    nexts = [p + list(r.output_ids) + encode(tiny, "\nUser: more\n") for p, r in zip(firsts, rs)]
    parted = firsts[0] + list(rs[0].output_ids[:4]) + encode(tiny, " instead, tell me")
    got = on.send([*nexts, parted], greedy(6))
    ref = off.send([*nexts, parted], greedy(6))
    for p, r, g, w in zip(firsts, rs, got, ref):
        assert cached(g) == len(p) + len(r.output_ids) - 1
        assert list(g.output_ids) == list(w.output_ids)
        assert g.store is not None and w.store is not None
        np.testing.assert_allclose(g.store.logprobs, w.store.logprobs, atol=1e-4)
    assert cached(got[3]) == len(firsts[0]) + 4
    assert list(got[3].output_ids) == list(ref[3].output_ids)
