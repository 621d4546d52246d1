"""Predicted Outputs through the real server and the `openai` SDK: the answer and every logprob
field equal the same request's without a prediction (the server verifies the prediction's drafts
with the model, runner/speculation.py), usage counts what was accepted, and a malformed
prediction is a 400 in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.helpers.server import MODEL_NAME, assert_openai_error

QUESTION = "Write a Python function that returns the factorial of n, with a docstring."


def ask(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=64,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        extra_body={"return_token_ids": True},
        **kw,
    )


def entries(choice: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in choice.logprobs.content
    ]


def same_entries(a: Any, b: Any) -> None:
    ea, eb = entries(a), entries(b)
    assert [e[0] for e in ea] == [e[0] for e in eb]
    np.testing.assert_allclose([e[1] for e in ea], [e[1] for e in eb], atol=1e-4)
    for (_, _, ta), (_, _, tb) in zip(ea, eb):
        np.testing.assert_allclose([v for _, v in ta], [v for _, v in tb], atol=1e-4)
        # top ids equal up to near-ties
        for (x, vx), (y, _) in zip(ta, tb):
            assert x == y or any(abs(vx - v) < 1e-4 for t, v in tb if t == x)


def test_a_prediction_changes_nothing_but_usage(client: openai.OpenAI) -> None:
    plain = ask(client)
    content = plain.choices[0].message.content
    assert content
    edited = content[: len(content) // 2] + "XYZ" + content[len(content) // 2 + 2 :]
    parts = [{"type": "text", "text": edited}]
    fast = ask(client, prediction={"type": "content", "content": parts})
    a, b = plain.choices[0], fast.choices[0]
    assert b.message.content == content and b.finish_reason == a.finish_reason
    assert b.model_extra["token_ids"] == a.model_extra["token_ids"]
    same_entries(a, b)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    details = fast.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 10
    assert details.rejected_prediction_tokens > 0
    assert fast.usage.completion_tokens == plain.usage.completion_tokens


def test_a_streamed_prediction_streams_the_same_answer(client: openai.OpenAI) -> None:
    plain = ask(client)
    content = plain.choices[0].message.content
    stream = ask(client, prediction={"type": "content", "content": content}, stream=True,
                 stream_options={"include_usage": True})  # fmt: skip
    text, lps, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                lps += [(e.token, e.logprob) for e in c.logprobs.content]
    assert text == content
    want = [(e.token, e.logprob) for e in plain.choices[0].logprobs.content]
    assert [t for t, _ in lps] == [t for t, _ in want]
    np.testing.assert_allclose([v for _, v in lps], [v for _, v in want], atol=1e-4)
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens > 10


@pytest.mark.parametrize(
    ("prediction", "param"),
    [
        ({"type": "text", "content": "x"}, "prediction.type"),
        ("just text", "prediction"),  # pydantic: not an object
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": []}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image", "text": "x"}]}, "prediction.content[0]"),
        ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
    ],
)
def test_a_malformed_prediction_is_a_400(server: str, prediction: Any, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "prediction": prediction}  # fmt: skip
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert_openai_error(r, 400, param)
