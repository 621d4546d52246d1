"""A server with a draft model (`--draft-model`: the served model as its own draft, every greedy
draft right) through the real server (uvicorn on loopback) and the `openai` SDK: greedy answers,
streamed and not, whose ids and logprob entries equal an independent full forward pass of the
served model, with speculative steps run on the way (runner/speculation.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner.speculation import Speculator
from tests.helpers.engine import count_verifies, encode, reference_logprobs
from tests.helpers.server import thread_server

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def counted() -> Iterator[list[int]]:
    """Tokens each speculative step emitted, as collected, over the module's server; the served
    model proposes all K (its draft costs as much as a step of its own, for which the length
    rule would say one)."""
    with pytest.MonkeyPatch.context() as mp:
        counts = count_verifies(mp)
        mp.setattr(Speculator, "_length", lambda self, row: self.k)
        yield counts


@pytest.fixture(scope="module")
def drafting(embedded: LoadedModel, embedded_dir: Path, counted: list[int]) -> Iterator[str]:
    """One server for the module (the draft model's load is most of a start): what a test
    reads of it is its own request's answer and the steps it emitted (`emitted`)."""
    cfg = EngineConfig(
        max_num_seqs=8, prefill_chunk=64, speculate="draft", draft_model=str(embedded_dir),
        num_draft_tokens=4,
    )  # fmt: skip
    with thread_server(embedded, cfg) as (url, _):
        yield url


@pytest.fixture
def emitted(drafting: str, counted: list[int]) -> list[int]:
    """The steps of this test's requests alone, on a fresh prefix cache: the server is idle
    between tests, and the other test's answer to the same prompt is flushed from its cache."""
    assert httpx.post(drafting + "/flush_cache", timeout=30).status_code == 200
    counted.clear()
    return counted


@pytest.fixture
def client(drafting: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=drafting + "/v1", api_key="-", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, stream: bool) -> tuple[list[int], list[int], list[Any]]:
    """(prompt ids, output ids, logprob entries) of one greedy completion."""
    body: dict[str, Any] = dict(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    if not stream:
        choice = client.completions.create(**body).choices[0]
        ids = choice.model_extra["token_ids"]
        lp = choice.logprobs
        return (
            choice.model_extra["prompt_token_ids"],
            ids,
            list(zip(lp.token_logprobs, lp.top_logprobs)),
        )
    prompt: list[int] = []
    ids, entries = [], []
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            prompt = choice.model_extra.get("prompt_token_ids") or prompt
            ids += choice.model_extra.get("token_ids") or []
            if choice.logprobs is not None:
                entries += zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)
    return prompt, ids, entries


@pytest.mark.parametrize("stream", [False, True])
def test_a_draft_model_server_answers_with_the_model_s_own_logprobs(
    client: openai.OpenAI, embedded: LoadedModel, emitted: list[int], stream: bool
) -> None:
    prompt, ids, entries = ask(client, stream)
    assert len(set(ids)) > 8  # a varied answer: each draft's place in it matters
    assert prompt == encode(embedded, PROMPT)
    assert len(ids) == len(entries) == 32
    ref = reference_logprobs(embedded, prompt + ids)[len(prompt) - 1 : -1]
    for tok, (lp, top), row in zip(ids, entries, ref):
        assert tok == int(np.argmax(row))  # greedy: the target's argmax, whatever was drafted
        assert abs(lp - row[tok]) < 1e-4
        np.testing.assert_allclose(
            sorted(top.values(), reverse=True), np.sort(row)[::-1][:5], atol=1e-4
        )
    # Verifies of 4 drafts, all taken, and the bonus token (until the off rule rests the row:
    # on the CPU a draft as dear as the model's own step does not pay).
    assert max(emitted) == 5 and sum(emitted) >= 10
