"""A fault inside one request ends that request with an error; the server and the requests that
share its batch go on exactly as if it had never been there."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.faults import AllocationFault, FaultyBytes, FaultyTokenizer, PoisonModel
from tests.helpers.server import TINY_NAME, thread_server, wait_idle
from tests.reliability.client import ChatResult, chat, chat_body

MARKER = "TOKENIZER-FAULT"
NEIGHBOURS = [f"Neighbour {i}: tell me about the number {i}." for i in range(8)]


@pytest.fixture(scope="module")
def poison_ids(tiny_served: LoadedModel) -> tuple[int, int]:
    """(a token whose input gives NaN logits, a token the detokenizer fails on)."""
    nan_id = tiny_served.tokenizer.encode("The zebra", add_special_tokens=False)[-1]
    return nan_id, nan_id + 1


@pytest.fixture(scope="module")
def faulty(tiny_served: LoadedModel, poison_ids: tuple[int, int]) -> Iterator[str]:
    nan_id, bytes_id = poison_ids
    table = FaultyBytes(tiny_served.vocab.token_bytes)
    table.poison = bytes_id
    model = replace(
        tiny_served,
        model=PoisonModel(tiny_served.model, nan_id),
        tokenizer=FaultyTokenizer(tiny_served.tokenizer, MARKER),
        vocab=replace(tiny_served.vocab, token_bytes=table),
    )
    cfg = EngineConfig(max_num_seqs=16, prefill_chunk=2048)  # whole prompts: poison in view
    limits = Limits(max_stop_chars=512)
    with thread_server(model, cfg, limits) as (base, _):
        yield base


def neighbour(i: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"temperature": 0, "max_tokens": 12 + i, "ignore_eos": True}
    if i % 2:
        kw |= {"logprobs": True, "top_logprobs": i % 4}
    return chat_body(NEIGHBOURS[i], stream=bool(i % 3 == 0), **kw)


async def together(base: str, bodies: list[dict[str, Any]]) -> list[ChatResult]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        return list(await asyncio.gather(*[chat(c, b) for b in bodies]))


async def one_by_one(base: str, bodies: list[dict[str, Any]]) -> list[ChatResult]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        return [await chat(c, b) for b in bodies]


def faulty_requests(poison_ids: tuple[int, int]) -> list[tuple[str, dict[str, Any]]]:
    nan_id, bytes_id = poison_ids
    never = ["\u2603" * 510 + f"{i:02d}" for i in range(16)]  # 16 stops of 512 characters, no match
    return [
        ("nan in prompt", chat_body("The zebra", max_tokens=8)),
        ("nan in prompt, stream", chat_body("The zebra", max_tokens=8, stream=True)),
        ("nan in prompt, logprobs", chat_body("The zebra", max_tokens=8, logprobs=True)),
        ("nan mid-stream", chat_body("x", max_tokens=8, stream=True, logit_bias={nan_id: 100})),
        ("nan mid-answer", chat_body("x", max_tokens=8, logit_bias={str(nan_id): 100})),
        ("detokenizer", chat_body("x", max_tokens=8, logit_bias={str(bytes_id): 100})),
        (
            "detokenizer, stream",
            chat_body(
                "y", max_tokens=8, stream=True, logit_bias={str(bytes_id): 100}, logprobs=True
            ),
        ),
        ("tokenizer", chat_body(f"say {MARKER}", max_tokens=8)),
        (
            "stop never matches",
            chat_body("z", max_tokens=40, temperature=0, ignore_eos=True, stop=never),
        ),
    ]


def test_faults_end_only_their_request(faulty: str, poison_ids: tuple[int, int]) -> None:
    bad = faulty_requests(poison_ids)
    bodies = [neighbour(i) for i in range(len(NEIGHBOURS))] + [b for _, b in bad]
    results = asyncio.run(together(faulty, bodies))
    near, far = (
        results[: len(NEIGHBOURS)],
        dict(zip([n for n, _ in bad], results[len(NEIGHBOURS) :])),
    )

    for name in ("nan in prompt", "nan in prompt, logprobs", "nan mid-answer", "detokenizer"):
        r = far[name]
        assert r.status == 500 and r.error is not None, (name, r)
        assert r.error["type"] == "server_error" and r.error["message"], name
    assert "non-finite" in far["nan in prompt"].error["message"]  # type: ignore[index]
    for name in ("nan in prompt, stream", "nan mid-stream", "detokenizer, stream"):
        r = far[name]
        assert r.status == 200 and r.error is not None and r.error["type"] == "server_error", name
        assert r.aligned, name
    # The forced token came out before the fault: the stream carried it, then the error.
    assert far["nan mid-stream"].token_ids == [poison_ids[0]]
    assert far["tokenizer"].status == 400 and far["tokenizer"].error["param"] == "messages"  # type: ignore[index]
    stop = far["stop never matches"]
    assert stop.status == 200 and stop.finish_reason == "length" and len(stop.token_ids) == 40

    alone = asyncio.run(one_by_one(faulty, [neighbour(i) for i in range(len(NEIGHBOURS))]))
    for got, want in zip(near, alone):
        assert got.status == want.status == 200 and got.error is None
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.aligned and want.aligned
        assert [e["logprob"] for e in got.entries] == pytest.approx(
            [e["logprob"] for e in want.entries], abs=1e-4
        )
    free = asyncio.run(one_by_one(faulty, [{**bad[-1][1], "stop": None}]))[0]
    assert free.text == stop.text and free.token_ids == stop.token_ids
    assert wait_idle(faulty)["cached_sequences"] == 0


def test_a_prefill_that_cannot_allocate_ends_only_its_request(tiny_dir: Path) -> None:
    """A prompt whose prefill fails to allocate memory (injected at its embedding) gets a 500
    naming the failure; the requests beside it in the same steps, streamed or not, are served
    as if it had never been there, and the engine goes on serving (a second round)."""
    model = load_model(str(tiny_dir))
    poison = model.tokenizer.encode(" avalanche", add_special_tokens=False)[-1]
    model.model.model.embed_tokens = AllocationFault(model.model.model.embed_tokens, poison)
    model = replace(model, name=TINY_NAME)
    cfg = EngineConfig(max_num_seqs=16, prefill_chunk=2048)
    with thread_server(model, cfg) as (base, _):
        for _ in range(2):
            bodies = [neighbour(i) for i in range(4)]
            bad = chat_body("Tell me about the avalanche", max_tokens=8)
            results = asyncio.run(together(base, [*bodies, bad]))
            err = results[-1]
            assert err.status == 500 and err.error is not None
            assert "could not be prefilled" in err.error["message"], err.error
            assert "Unable to allocate" in err.error["message"]
            alone = asyncio.run(one_by_one(base, bodies))
            for got, want in zip(results[:-1], alone):
                assert got.status == want.status == 200 and got.error is None
                assert got.token_ids == want.token_ids and got.text == want.text
        assert wait_idle(base)["cached_sequences"] == 0
