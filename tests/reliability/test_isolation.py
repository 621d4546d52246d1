"""64 concurrent mixed requests: streamed and not, greedy, seeded and unseeded sampling, with and
without logprobs, penalties and stops. Each answer passes the alignment invariant and equals what
the same request gives alone (token for token where the request is deterministic)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.server import thread_server, wait_idle
from tests.reliability.client import chat_body
from tests.reliability.test_faults import one_by_one, together

N = 64


def mixed(i: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": 6 + i % 17, "ignore_eos": True, "stream": bool(i % 2)}
    kw |= [
        {"temperature": 0},
        {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i},
        {"temperature": 1.2, "top_k": 20, "min_p": 0.01, "seed": 2000 + i},
        {"temperature": 1.0},  # unseeded: only the invariants can be checked
    ][i % 4]
    if i % 3:
        kw |= {"logprobs": True, "top_logprobs": i % 6}
    if i % 5 == 0:
        kw["stop"] = ["the", "\n"]
    if i % 7 == 0:
        kw |= {"presence_penalty": 0.5, "repetition_penalty": 1.2}
    return chat_body(f"Request {i}: " + "lorem ipsum " * (i % 13 * 6), **kw)


@pytest.fixture(scope="module")
def base(tiny_served: LoadedModel) -> Iterator[str]:
    with thread_server(tiny_served) as (url, _):
        yield url


def test_64_concurrent_mixed_equal_alone(base: str) -> None:
    bodies = [mixed(i) for i in range(N)]
    batch = asyncio.run(together(base, bodies))
    alone = asyncio.run(one_by_one(base, bodies))
    for i, (got, want, body) in enumerate(zip(batch, alone, bodies)):
        assert got.status == 200 and got.error is None, (i, got)
        assert got.aligned and want.aligned, i
        deterministic = "seed" in body or body["temperature"] == 0
        assert got.finish_reason in ("stop", "length")
        assert len(got.token_ids) <= body["max_tokens"]
        if body.get("logprobs"):
            assert len(got.entries) == len(got.token_ids), i
            assert all(len(e["top_logprobs"]) == body["top_logprobs"] for e in got.entries)
        if deterministic:
            assert got.token_ids == want.token_ids and got.text == want.text, i
            assert got.finish_reason == want.finish_reason
            assert [e["logprob"] for e in got.entries] == pytest.approx(
                [e["logprob"] for e in want.entries], abs=1e-4
            )
    assert wait_idle(base)["cached_sequences"] == 0
