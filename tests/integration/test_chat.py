"""Chat completions through the real server and the real `openai` client, checked against an
independent full forward pass of the same model."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import reference_logprobs
from tests.helpers.server import MODEL_NAME, chat

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Translate 'good morning' into Japanese.",
]


def entries_as_tuples(content: list[Any]) -> list[tuple[str, float, tuple[int, ...] | None, list]]:
    return [
        (
            e.token,
            e.logprob,
            tuple(e.bytes) if e.bytes is not None else None,
            [(t.token, t.logprob) for t in e.top_logprobs],
        )
        for e in content
    ]


def test_logprobs_equal_full_forward_pass(client: openai.OpenAI, embedded: LoadedModel) -> None:
    r = chat(
        client,
        QUESTIONS[0],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    prompt, out = r.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(out) == r.usage.completion_tokens
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    for i, (e, tok) in enumerate(zip(content, out)):
        row = ref[i]
        assert abs(e.logprob - row[tok]) < 1e-4
        assert e.top_logprobs[0].logprob == e.logprob  # greedy: the sampled token is the argmax
        want = np.sort(row)[::-1][:5]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], want, atol=1e-4)
        assert bytes(e.bytes or b"") == (embedded.vocab.token_bytes[tok] or b"")
    texts = b"".join(bytes(e.bytes or b"") for e in content).decode()
    assert texts == choice.message.content
    assert "Paris" in choice.message.content


def test_stream_entries_equal_non_stream(client: openai.OpenAI) -> None:
    # 40 tokens: the non-streamed body is formatted as its entries arrive, 16 tokens at a time
    kw = dict(
        max_tokens=40,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    full = chat(client, QUESTIONS[3], **kw).choices[0]
    assert len(full.logprobs.content) == 40
    chunks = list(
        chat(client, QUESTIONS[3], stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    text, entries = "", []
    for c in chunks[1:]:
        if not c.choices:
            assert c.usage.completion_tokens == len(entries)
            continue
        ch = c.choices[0]
        if ch.finish_reason is not None:
            assert ch.logprobs is None
            continue
        text += ch.delta.content or ""
        entries += ch.logprobs.content
        chunk_bytes = b"".join(bytes(e.bytes or b"") for e in ch.logprobs.content)
        assert chunk_bytes.decode("utf-8", errors="replace") == (ch.delta.content or "")
    assert text == full.message.content
    # The second request starts from the first's cached prefix: float32 results may move in
    # their last bits (as in another batch), nothing else.
    a, b = entries_as_tuples(entries), entries_as_tuples(full.logprobs.content)
    assert [(t, bs, [x for x, _ in top]) for t, _, bs, top in a] == [
        (t, bs, [x for x, _ in top]) for t, _, bs, top in b
    ]
    np.testing.assert_allclose([e[1] for e in a], [e[1] for e in b], atol=1e-4)
    np.testing.assert_allclose(
        [lp for e in a for _, lp in e[3]], [lp for e in b for _, lp in e[3]], atol=1e-4
    )


def test_sampled_tokens_are_in_their_own_entries(client: openai.OpenAI, embedded) -> None:
    r = chat(
        client,
        QUESTIONS[1],
        max_tokens=30,
        temperature=1.0,
        seed=11,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    prompt, out = r.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    for i, (e, tok) in enumerate(zip(choice.logprobs.content, out)):
        assert e.top_logprobs == []
        assert abs(e.logprob - ref[i][tok]) < 1e-4


def test_sixteen_concurrent_greedy_equal_alone(
    client: openai.OpenAI, aclient: openai.AsyncOpenAI
) -> None:
    questions = [f"{QUESTIONS[i % 4]} (variant {i})" for i in range(16)]
    kw = dict(temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})

    async def together() -> list[Any]:
        return await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": q}],
                    max_tokens=8 + i % 9,
                    **kw,
                )
                for i, q in enumerate(questions)
            ]
        )

    batch = asyncio.run(together())
    for i, q in enumerate(questions):
        alone = chat(client, q, max_tokens=8 + i % 9, **kw).choices[0]
        got = batch[i].choices[0]
        assert got.message.content == alone.message.content
        a, b = got.logprobs.content, alone.logprobs.content
        assert [e.token for e in a] == [e.token for e in b]
        np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b], atol=1e-4)


def test_shared_template_prefix_is_cached_and_reported(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    """Two chats in a row share the chat template's system turn: the second starts from its
    kept keys and values, says so in usage, and its logprobs still equal a full forward."""
    kw: dict[str, Any] = dict(
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    first = chat(client, QUESTIONS[1], **kw).model_extra["prompt_token_ids"]
    r = chat(client, QUESTIONS[2], **kw)
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    # The first chat is kept whole: the second takes every token the two prompts share (or
    # more, where an earlier request on this server shares more).
    shared = next(i for i, (a, b) in enumerate(zip(first, prompt)) if a != b)
    assert 16 <= shared <= r.usage.prompt_tokens_details.cached_tokens < len(prompt)
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    for e, tok, row in zip(r.choices[0].logprobs.content, out, ref):
        assert abs(e.logprob - row[tok]) < 1e-4


def test_no_logprobs_means_null(client: openai.OpenAI) -> None:
    r = chat(client, QUESTIONS[2], max_tokens=4)
    assert r.choices[0].logprobs is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_stop_string_is_not_returned(client: openai.OpenAI) -> None:
    free = chat(client, QUESTIONS[0], max_tokens=24, temperature=0).choices[0].message.content
    stop = free[8:12]
    r = chat(client, QUESTIONS[0], max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert r.message.content == free[: free.index(stop)]
    assert r.finish_reason == "stop"


def entry_text(entries: list[Any]) -> str:
    return b"".join(bytes(e.bytes or b"") for e in entries).decode("utf-8", "replace")


def test_stop_string_mid_token_streams_whole_tokens(client: openai.OpenAI) -> None:
    """A stop string that begins inside a token: the stream holds that token back whole, each
    chunk's text is exactly its entries' bytes, and the last chunk's entries go on through the
    stop string (whose text is cut), as the non-streamed answer's do."""
    kw = dict(max_tokens=40, temperature=0, logprobs=True)
    free = chat(client, QUESTIONS[1], **kw).choices[0]
    tokens = [e.token for e in free.logprobs.content]
    offsets = np.cumsum([0] + [len(t) for t in tokens])
    # a stop string from the last 2 characters of a word token into the next token
    j = next(i for i in range(2, len(tokens) - 2) if len(tokens[i].strip()) >= 3)
    stop = tokens[j][-2:] + tokens[j + 1][:2]
    cut = int(offsets[j + 1]) - 2
    assert free.message.content.find(stop) == cut
    plain = chat(client, QUESTIONS[1], stop=[stop], **kw).choices[0]
    assert plain.message.content == free.message.content[:cut] and plain.finish_reason == "stop"
    assert len(plain.logprobs.content) == j + 2  # the tokens that completed the stop string
    chunks = [c.choices[0] for c in chat(client, QUESTIONS[1], stop=[stop], stream=True, **kw)]
    body = [c for c in chunks[1:] if c.finish_reason is None]
    texts = [c.delta.content or "" for c in body]
    joined = [entry_text(c.logprobs.content) for c in body]
    assert texts[:-1] == joined[:-1]
    assert joined[-1].startswith(texts[-1]) and joined[-1][len(texts[-1]) :].startswith(stop)
    assert "".join(texts) == plain.message.content
    assert entries_as_tuples([e for c in body for e in c.logprobs.content]) == entries_as_tuples(
        plain.logprobs.content
    )
    # the token where the stop string begins went out only with the one that completed it
    assert tokens[j] in [e.token for e in body[-1].logprobs.content]


def test_models_and_health(client: openai.OpenAI, server: str) -> None:
    import httpx

    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server + "/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10_000_000}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 257}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"n": 17}, "n"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"model": "no-such-model"}, "model"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_input_gets_openai_error(server: str, body: dict[str, Any], param: str) -> None:
    import httpx

    payload = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(server + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "x", "messages": NaN}', b"[]", b""])
def test_malformed_bodies_get_400(server: str, raw: bytes) -> None:
    import httpx

    r = httpx.post(
        server + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
