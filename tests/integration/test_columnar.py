"""The compact logprobs form (`logprobs_format`: columnar, base64) through the real server: the
same values, bit for bit, as the OpenAI shape of the same seeded request, for chat and
completions, streamed and not, prompt logprobs included; decoded by the package's helper."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.logprobs.columnar import Block, decode_block
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import reference_logprobs
from tests.helpers.server import MODEL_NAME, assert_openai_error

FORMATS = ["columnar", "base64"]
SAMPLED = {"temperature": 0.8, "seed": 11, "max_tokens": 20}


def token_ids_of(entries: list[Any]) -> list[int]:
    """Ids from `return_tokens_as_token_ids` strings ("token_id:N")."""
    return [int(e.token.split(":")[1]) for e in entries]


def as_block(content: list[Any]) -> Block:
    """The OpenAI shape's entries (with token ids as strings) as a block, for comparison."""
    return Block(
        np.array(token_ids_of(content), np.int32),
        np.array([e.logprob for e in content], np.float32),
        np.zeros(len(content), np.int32),  # the OpenAI shape has no rank
        np.array([token_ids_of(e.top_logprobs) for e in content], np.int32),
        np.array([[t.logprob for t in e.top_logprobs] for e in content], np.float32),
    )


def same_values(a: Block, b: Block, ranks: bool = False) -> None:
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs.view(np.int32), b.logprobs.view(np.int32))  # bits
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    np.testing.assert_array_equal(a.top_logprobs.view(np.int32), b.top_logprobs.view(np.int32))
    if ranks:
        np.testing.assert_array_equal(a.ranks, b.ranks)


def chat(client: openai.OpenAI, fmt: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name three colours."}],
        logprobs=True,
        top_logprobs=5,
        **SAMPLED,
        extra_body={"logprobs_format": fmt, "return_token_ids": True, **extra},
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_chat_compact_equals_openai_shape(
    client: openai.OpenAI, embedded: LoadedModel, fmt: str
) -> None:
    chat(client, fmt)  # the prompt is now a kept prefix: both requests below compute alike
    plain = chat(client, "openai", return_tokens_as_token_ids=True)
    r = chat(client, fmt)
    assert r.choices[0].logprobs.model_extra["format"] == fmt
    assert r.choices[0].logprobs.refusal is None
    block = decode_block(r.choices[0].logprobs.content)  # the client keeps the raw object
    same_values(block, as_block(plain.choices[0].logprobs.content))
    out = r.choices[0].model_extra["token_ids"]
    assert block.token_ids.tolist() == out == plain.choices[0].model_extra["token_ids"]
    assert r.choices[0].message.content == plain.choices[0].message.content
    # The ranks, which only this form carries, against an independent float32 forward pass.
    prompt = r.model_extra["prompt_token_ids"]
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    for i, tok in enumerate(out):
        assert block.ranks[i] == int((ref[i] >= ref[i][tok] - 1e-5).sum())


@pytest.mark.parametrize("fmt", FORMATS)
def test_chat_stream_blocks_add_up_to_the_whole(client: openai.OpenAI, fmt: str) -> None:
    chat(client, fmt)  # a kept prefix, as in the test above
    whole = decode_block(chat(client, fmt).choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name three colours."}],
        logprobs=True,
        top_logprobs=5,
        stream=True,
        **SAMPLED,
        extra_body={"logprobs_format": fmt},
    )
    blocks = [
        decode_block(c.choices[0].logprobs.content)
        for c in stream
        if c.choices and c.choices[0].logprobs is not None
    ]
    assert len(blocks) > 1
    joined = Block.concat(blocks)
    same_values(joined, whole, ranks=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_completions_echo_and_prompt_logprobs(server: str, fmt: str) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "The cat sat on the",
        "max_tokens": 6,
        "logprobs": 3,
        "echo": True,
        "prompt_logprobs": 2,
        "temperature": 0,
        "return_token_ids": True,
    }
    for _ in range(2):  # the second computes as the third: the prompt is a kept prefix
        plain = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    r = httpx.post(server + "/v1/completions", json={**body, "logprobs_format": fmt}, timeout=60)
    choice = r.json()["choices"][0]
    assert choice["text"] == plain["text"]
    lp = choice["logprobs"]
    assert lp["format"] == fmt
    prompt, completion = decode_block(lp["prompt"]), decode_block(lp["completion"])
    legacy = plain["logprobs"]["token_logprobs"]
    n_prompt = len(plain["prompt_token_ids"])
    assert legacy[0] is None and len(prompt) == n_prompt - 1
    assert prompt.token_ids.tolist() == plain["prompt_token_ids"][1:]
    assert completion.token_ids.tolist() == plain["token_ids"]
    flat = np.concatenate([prompt.logprobs, completion.logprobs])
    assert flat.tolist() == np.array(legacy[1:], np.float32).tolist()
    for i, top in enumerate(plain["logprobs"]["top_logprobs"][1:]):
        row = (
            prompt.top_logprobs[i] if i < len(prompt) else completion.top_logprobs[i - len(prompt)]
        )
        assert (
            sorted(row.tolist(), reverse=True)
            == sorted(np.array(list(top.values()), np.float32).tolist(), reverse=True)[: len(row)]
        )
    # vLLM's prompt_logprobs: the same positions as a block of their own, top 2.
    scored = decode_block(choice["prompt_logprobs"])
    assert scored.top_ids.shape == (n_prompt - 1, 2)
    for i, pos in enumerate(plain["prompt_logprobs"][1:]):
        tid = scored.token_ids[i]
        assert np.float32(pos[str(tid)]["logprob"]) == scored.logprobs[i]
        assert pos[str(tid)]["rank"] == scored.ranks[i]
        for j in range(2):
            assert (
                np.float32(pos[str(scored.top_ids[i, j])]["logprob"]) == scored.top_logprobs[i, j]
            )


def test_base64_is_little_endian_buffers(client: openai.OpenAI) -> None:
    lp = chat(client, "base64").choices[0].logprobs.content
    assert set(lp) == {"n", "k", "token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"}
    assert lp["k"] == 5 and len(json.dumps(lp)) < len(
        json.dumps(chat(client, "columnar").choices[0].logprobs.content)
    )


def test_unknown_format_is_a_400(server: str) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
            "logprobs": True, "logprobs_format": "arrow"}  # fmt: skip
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(r, 400, "logprobs_format")
