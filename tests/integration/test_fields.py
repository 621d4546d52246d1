"""The fields OpenAI and vLLM clients send, through the real server and the real `openai` client
(`extra_body` for vLLM's): unknown fields, refused features, system_fingerprint and usage
details, logprobs_mode's four values against an independent float32 forward pass, chat n,
continuation and echo, and vLLM's generation controls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.server import MODEL_NAME, chat, server_process

Q = "Tell me a story about a dragon."


def user(q: str = Q) -> list[dict[str, Any]]:
    return [{"role": "user", "content": q}]


def logits_after(model: LoadedModel, prompt: list[int], out: list[int]) -> np.ndarray:
    """[len(out), V] float64: the model's own logits before each generated token, from one
    forward pass of the whole sequence."""
    x = model.model(mx.array([prompt + out]))[0].astype(mx.float32)
    return np.array(x, np.float64)[len(prompt) - 1 : len(prompt) - 1 + len(out)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


# ---- unknown and refused fields --------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_unknown_field_is_a_400_naming_it(client: openai.OpenAI, endpoint: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            chat(client, "hi", max_tokens=2, extra_body={"top_logprob": 3})
        else:
            client.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"top_logprob": 3}
            )
    err = e.value.body
    assert err["message"] == "Unrecognized request argument supplied: top_logprob"
    assert err["param"] == "top_logprob" and err["type"] == "invalid_request_error"


def test_unknown_field_in_a_stream_is_a_400_before_it_starts(server: str) -> None:
    body = {"model": MODEL_NAME, "messages": user("hi"), "stream": True, "max_token": 5}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"


def test_unknown_field_on_tokenize_and_detokenize_is_a_400(server: str) -> None:
    """The tokenizer routes read their bodies as the completions routes do: an undeclared
    field is a 400 naming it; vLLM's `return_token_strs` and `continue_final_message` are
    declared."""
    for path, body in (
        ("/tokenize", {"prompt": "hi", "add_special_token": False}),
        ("/tokenize", {"messages": user("hi"), "tool": []}),
        ("/detokenize", {"tokens": [1, 2], "skip_special_tokens": True}),
    ):
        r = httpx.post(server + path, json=body, timeout=30)
        name = next(k for k in body if k not in ("prompt", "messages", "tokens"))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and err["code"] == "unknown_parameter"
        assert err["message"] == f"Unrecognized request argument supplied: {name}"
    r = httpx.post(server + "/tokenize", json={"prompt": "a cat", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["token_strs"] == ["a", "Ġcat"]
    msgs = [*user("hi"), {"role": "assistant", "content": "Hel"}]
    cont = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(server + "/tokenize", json=cont).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nHel")  # the last message left open


NOT_A_SCHEMA = {"type": "json_schema", "json_schema": {"schema": 3}}


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"extra_body": {"functions": [{"name": "f", "parameters": {}}]}}, "functions"),
        ({"response_format": NOT_A_SCHEMA}, "response_format"),
        ({"store": True}, "store"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs"),
        ({"extra_body": {"stream_options": {"include_usage": True, "x": 1}}}, "stream_options.x"),
    ],
)
def test_what_cannot_be_honoured_is_refused(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_routine_openai_fields_are_accepted(client: openai.OpenAI) -> None:
    r = chat(
        client,
        "hi",
        max_tokens=3,
        temperature=0,
        metadata={"run": "7"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
        response_format={"type": "text"},
        modalities=["text"],
        user="u1",
        seed=1,
        stream=False,
    )
    assert r.choices[0].message.content


def test_fingerprint_and_usage_details_everywhere(client: openai.OpenAI) -> None:
    r = chat(client, "hi", max_tokens=3, temperature=0)
    fp = r.system_fingerprint
    assert fp and fp.startswith("fp_")
    d = r.usage.completion_tokens_details
    assert d.reasoning_tokens == 0 and d.accepted_prediction_tokens == 0
    assert d.audio_tokens == 0 and d.rejected_prediction_tokens == 0
    c = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert c.system_fingerprint == fp and c.usage.completion_tokens_details.reasoning_tokens == 0
    for stream in (
        chat(client, "hi", max_tokens=3, stream=True, stream_options={"include_usage": True}),
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, stream=True),
    ):
        chunks = list(stream)
        assert chunks and all(ch.system_fingerprint == fp for ch in chunks)
    assert chunks[-1].usage is None or chunks[-1].usage.completion_tokens_details is not None


def test_ignore_unknown_fields_warns_and_names_them(tiny_dir: Path) -> None:
    args = ["--model", str(tiny_dir), "--ignore-unknown-fields", "--engine", "thread"]
    with server_process(args) as s:
        body = {
            "model": tiny_dir.name,
            "messages": user("hi"),
            "max_tokens": 2,
            "vendor_x": 1,
            "stream_options": {"include_usage": True, "y": 2},
            "stream": True,
        }
        with httpx.stream("POST", s.base + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.read().decode().endswith("data: [DONE]\n\n")
            assert r.headers["x-ignored-fields"] == "vendor_x, stream_options.y"
        r = httpx.post(s.base + "/v1/completions", json={**body, "prompt": "a", "stream": False})
        assert r.status_code == 200, r.text
        assert "ignored unknown request fields: vendor_x" in s.log()
        r = httpx.post(s.base + "/tokenize", json={"prompt": "hi", "vendor_x": 1})
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "vendor_x"
        r = httpx.post(s.base + "/detokenize", json={"tokens": r.json()["tokens"], "y": 0})
        assert r.json()["prompt"] == "hi" and r.headers["x-ignored-fields"] == "y"


# ---- logprobs_mode ---------------------------------------------------------------------------
def test_logprobs_modes_raw_and_processed(client: openai.OpenAI, embedded: LoadedModel) -> None:
    """With a logit bias and a temperature: raw is the plain model log-softmax, processed the
    log-softmax of the biased, tempered logits; raw_logits and processed_logits the values."""
    target = embedded.tokenizer.encode(" the")[0]
    bias, temp = 4.0, 0.7
    runs = {}
    for mode in ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"):
        runs[mode] = chat(
            client,
            Q,
            max_tokens=10,
            temperature=temp,
            seed=123,
            logit_bias={str(target): bias},
            logprobs=True,
            top_logprobs=2,
            extra_body={"logprobs_mode": mode, "return_token_ids": True, "ignore_eos": True},
        )
    first = runs["raw_logprobs"]
    prompt, out = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    assert all(r.choices[0].model_extra["token_ids"] == out for r in runs.values())
    rows = logits_after(embedded, prompt, out)
    for mode, r in runs.items():
        for i, (tok, e) in enumerate(zip(out, r.choices[0].logprobs.content)):
            x = rows[i].copy()
            if mode.startswith("processed"):
                x[target] += bias
                x /= temp
            want = x if mode.endswith("logits") else log_softmax(x)
            assert abs(e.logprob - want[tok]) < 1e-4, (mode, i)
            tops = [t.logprob for t in e.top_logprobs]
            np.testing.assert_allclose(tops, np.sort(want)[::-1][:2], atol=1e-4)


# ---- chat n ----------------------------------------------------------------------------------
def test_chat_n_equals_seeded_single_requests(client: openai.OpenAI) -> None:
    """n=4 with seed s: one prefill, four streams; choice i is what a single request with seed
    s + i samples (vLLM's rule), whatever else runs beside it."""
    kw: dict[str, Any] = dict(max_tokens=12, temperature=1.0, logprobs=True)
    many = chat(client, Q, n=4, seed=50, extra_body={"return_token_ids": True}, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in many.choices]
    assert len(set(texts)) == 4
    for i, c in enumerate(many.choices):
        one = chat(client, Q, seed=50 + i, extra_body={"return_token_ids": True}, **kw)
        assert one.choices[0].model_extra["token_ids"] == c.model_extra["token_ids"]
        assert one.choices[0].message.content == c.message.content
        mine = [e.logprob for e in c.logprobs.content]  # the prefix cache moves last bits
        np.testing.assert_allclose([e.logprob for e in one.choices[0].logprobs.content], mine,
                                   atol=1e-4)  # fmt: skip
    assert many.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in many.choices
    )
    assert many.usage.prompt_tokens == len(many.model_extra["prompt_token_ids"])


def test_chat_n_streams_every_choice(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(max_tokens=8, temperature=1.0, seed=9)
    whole = chat(client, Q, n=3, **kw)
    stream = chat(client, Q, n=3, stream=True, stream_options={"include_usage": True}, **kw)
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str] = {}
    usage = None
    for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [text[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


# ---- continuation and echo -------------------------------------------------------------------
PREFIX = "Once upon a time, the dragon"


def test_continue_final_message(client: openai.OpenAI, embedded: LoadedModel) -> None:
    messages = [*user(), {"role": "assistant", "content": PREFIX}]
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_ids": True,
            "echo": True,
        },
    )
    want = embedded.tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=False
    )
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == list(embedded.tokenizer.encode(want, add_special_tokens=False))
    assert embedded.tokenizer.decode(prompt).endswith(PREFIX)  # no end of turn, no new turn
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.startswith(PREFIX)
    generated = embedded.tokenizer.decode(r.choices[0].model_extra["token_ids"])
    assert msg.content == PREFIX + generated
    # echo also scores the prompt, as vLLM does: its logprobs come back with it
    assert len(r.model_extra["prompt_logprobs"]) == len(prompt)


def test_continuation_conflict_and_streamed_echo(client: openai.OpenAI) -> None:
    messages = [*user(), {"role": "assistant", "content": PREFIX}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"continue_final_message": True},  # add_generation_prompt: true
        )
    assert e.value.body["param"] == "continue_final_message"
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    kw: dict[str, Any] = dict(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0)
    whole = client.chat.completions.create(extra_body=extra, **kw)
    chunks = list(client.chat.completions.create(stream=True, extra_body=extra, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed.startswith(PREFIX)
    # without a generation prompt the reply continues the last message, whatever its role
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user("The sky is"),  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"add_generation_prompt": False, "echo": True},
    )
    assert plain.choices[0].message.role == "user"
    assert plain.choices[0].message.content.startswith("The sky is")


# ---- vLLM's generation controls ---------------------------------------------------------------
def test_min_tokens_outlasts_eos(client: openai.OpenAI, embedded: LoadedModel) -> None:
    short = chat(client, "Say hi.", max_tokens=60, temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40
    longer = chat(client, "Say hi.", max_tokens=60, temperature=0, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=3, extra_body={"min_tokens": 4})
    assert e.value.body["param"] == "min_tokens"


def test_allowed_token_ids_and_bad_words(client: openai.OpenAI, embedded: LoadedModel) -> None:
    tok = embedded.tokenizer
    allowed = sorted(set(tok.encode(" yes no maybe")))
    r = chat(
        client,
        Q,
        max_tokens=8,
        temperature=1.0,
        seed=4,
        logprobs=True,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                    "logprobs_mode": "processed_logprobs", "ignore_eos": True},
    )  # fmt: skip
    out = r.choices[0].model_extra["token_ids"]
    assert set(out) <= set(allowed)
    rows = logits_after(embedded, r.model_extra["prompt_token_ids"], out)
    for i, t in enumerate(out):  # processed: the distribution over the allowed ids alone
        sub = rows[i][allowed]
        want = sub - (sub.max() + np.log(np.exp(sub - sub.max()).sum()))
        assert abs(r.choices[0].logprobs.content[i].logprob - want[allowed.index(t)]) < 1e-4
    free = chat(client, "What is the capital of France?", max_tokens=20, temperature=0)
    assert "Paris" in free.choices[0].message.content
    banned = chat(
        client,
        "What is the capital of France?",
        max_tokens=20,
        temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )
    assert "Paris" not in banned.choices[0].message.content


def test_stop_string_and_special_tokens_in_text(client: openai.OpenAI) -> None:
    free = chat(client, Q, max_tokens=20, temperature=0).choices[0].message.content
    stop = free[8:11]
    kept = chat(client, Q, max_tokens=20, temperature=0, stop=[stop],
                extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].message.content == free[: free.index(stop) + len(stop)]
    end = chat(
        client,
        "Say hi.",
        max_tokens=60,
        temperature=0,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True},
    )
    assert end.choices[0].message.content.endswith("<|im_end|>")
    plain = chat(client, "Say hi.", max_tokens=60, temperature=0,
                 extra_body={"skip_special_tokens": False})  # fmt: skip
    assert end.choices[0].message.content == plain.choices[0].message.content + "<|im_end|>"
    # spaces_between_special_tokens: text is the tokens' own bytes, so either value is the same
    for spaces in (False, True):
        extra = {"skip_special_tokens": False, "include_stop_str_in_output": True,
                 "spaces_between_special_tokens": spaces}  # fmt: skip
        same = chat(client, "Say hi.", max_tokens=60, temperature=0, extra_body=extra)
        assert same.choices[0].message.content == end.choices[0].message.content


def test_truncate_prompt_tokens(client: openai.OpenAI) -> None:
    ids = list(range(100, 140))
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=ids,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 7, "return_token_ids": True},
    )
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[-7:]
    assert r.usage.prompt_tokens == 7
