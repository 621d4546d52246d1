"""Ollama's API through the real server (uvicorn on loopback) and the real `ollama` client: chat
with tools and thinking, streamed and not (the scripted model: every logprob in closed form);
generate, templated and raw, streamed and not (the tiny random model: logprobs against a
float32 forward pass, 1e-4); list, show, ps, version; Ollama's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import ollama
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import reference_logprobs
from tests.helpers.scripted import expected
from tests.helpers.scripted_tools import CASES, TOOLS, case_ids
from tests.helpers.server import thread_server
from tests.integration.test_responses import ANSWER, MODEL, Weather, scripted_model  # noqa: F401

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def scripted_url(scripted_model: LoadedModel) -> Iterator[str]:  # noqa: F811
    with thread_server(scripted_model, reasoning=True, tool_format="hermes") as (url, _):
        yield url


@pytest.fixture(scope="module")
def tiny_url(tiny: LoadedModel) -> Iterator[str]:
    with thread_server(tiny) as (url, _):
        yield url


def chat(url: str, case: str, stream: bool, **kw: Any) -> tuple[dict[str, Any], list[Any]]:
    """The answer as one dict (streamed: the chunks joined), and the chunks' logprobs."""
    c = ollama.Client(host=url)
    messages = [{"role": "user", "content": f"Case: {case}"}]
    args: dict[str, Any] = dict(model=MODEL, messages=messages, tools=TOOLS, options=GREEDY,
                                logprobs=True, top_logprobs=3, **kw)  # fmt: skip
    if not stream:
        r = c.chat(**args)
        return r.model_dump(), list(r.logprobs or [])
    content, thinking, calls, entries = "", "", [], []
    for part in c.chat(**args, stream=True):
        content += part.message.content or ""
        thinking += part.message.thinking or ""
        calls += part.message.tool_calls or []
        entries += part.logprobs or []
        last = part
    out = last.model_dump()
    out["message"].update(content=content, thinking=thinking or None,
                          tool_calls=[c.model_dump() for c in calls] or None)  # fmt: skip
    return out, entries


@pytest.mark.parametrize("stream", [False, True], ids=["json", "ndjson"])
def test_chat_with_thinking_and_a_tool_call(
    scripted_url: str,
    scripted_model: LoadedModel,  # noqa: F811
    stream: bool,
) -> None:
    r, entries = chat(scripted_url, "think", stream, think=True)
    case = CASES["think"]
    msg = r["message"]
    assert msg["thinking"] == case.reasoning and msg["content"] == case.content
    calls = [(c["function"]["name"], dict(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == case.calls
    assert r["done"] and r["done_reason"] == "stop"
    ids, _ = case_ids(scripted_model, "think")
    closed_form([e.model_dump() for e in entries], ids, scripted_model.vocab, 3)
    assert r["eval_count"] == len(ids)


def test_a_tool_loop(scripted_url: str) -> None:
    c = ollama.Client(host=scripted_url)
    history: list[Any] = [{"role": "user", "content": "Case: forced"}]
    r = c.chat(model=MODEL, messages=history, tools=TOOLS, options=GREEDY)
    call = r.message.tool_calls[0]
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    history += [r.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    r = c.chat(model=MODEL, messages=history, tools=TOOLS, options=GREEDY,
               format=Weather.model_json_schema())  # fmt: skip
    assert Weather.model_validate_json(r.message.content) == ANSWER


@pytest.mark.parametrize("raw", [False, True], ids=["templated", "raw"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "ndjson"])
def test_generate_logprobs_equal_a_float32_forward_pass(
    tiny: LoadedModel, tiny_url: str, raw: bool, stream: bool
) -> None:
    c = ollama.Client(host=tiny_url)
    options = {"num_predict": 10, "seed": 3, "temperature": 1.0}
    args: dict[str, Any] = dict(model=tiny.name, prompt="The capital of France", raw=raw,
                                logprobs=True, top_logprobs=4, options=options)  # fmt: skip
    if stream:
        parts = list(c.generate(**args, stream=True))
        text = "".join(p.response or "" for p in parts)
        entries = [e for p in parts for e in (p.logprobs or [])]
        last = parts[-1]
    else:
        last = c.generate(**args)
        text, entries = last.response, list(last.logprobs or [])
    assert last.done and last.eval_count == len(entries)
    assert last.done_reason in ("stop", "length")
    if raw:
        prompt = list(tiny.tokenizer.encode("The capital of France"))
    else:
        messages = [{"role": "user", "content": "The capital of France"}]
        prompt = httpx.post(tiny_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert last.prompt_eval_count == len(prompt)
    vocab = tiny.vocab
    ids = [_id_of(e.model_dump(), vocab) for e in entries]
    ref = reference_logprobs(tiny, prompt + ids)[len(prompt) - 1 : -1]
    for i, (e, tid) in enumerate(zip(entries, ids)):
        assert abs(e.logprob - ref[i, tid]) < 1e-4
        top = sorted(ref[i])[::-1][:4]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], top, atol=1e-4)
    assert text.startswith(b"".join(vocab.token_bytes[t] or b"" for t in ids[:1]).decode(
        "utf-8", "ignore")[:1])  # fmt: skip


def closed_form(entries: list[dict[str, Any]], ids: list[int], vocab: Any, k: int) -> None:
    """Entries as the `ollama` client reads them (token and logprob: its models keep no
    `bytes`) against the scripted model's closed form, step by step."""
    assert len(entries) == len(ids)
    for step, (e, tid) in enumerate(zip(entries, ids)):
        want = expected(step, tid, len(vocab))
        assert e["token"] == vocab.token_text[tid] and abs(e["logprob"] - want.logprob) < 2e-5
        tops = e["top_logprobs"]
        assert [t["token"] for t in tops] == [vocab.token_text[t] for t, _ in want.top[:k]]
        np.testing.assert_allclose([t["logprob"] for t in tops], [v for _, v in want.top[:k]],
                                   atol=2e-5)  # fmt: skip


def _id_of(entry: dict[str, Any], vocab: Any) -> int:
    """The token id an entry names, by its text (the logprob check against the reference
    catches a namesake)."""
    return int(vocab.token_text.index(entry["token"]))


def test_list_show_ps_version(scripted_url: str) -> None:
    c = ollama.Client(host=scripted_url)
    names = [m.model for m in c.list().models]
    assert names == [MODEL]
    shown = c.show(MODEL + ":latest")
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities or [])
    assert [m.model for m in c.ps().models] == [MODEL]
    assert httpx.get(scripted_url + "/api/version").json()["version"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/chat", {"messages": []}),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "x"}], "options": {"mirostat": 2}},
        ),  # fmt: skip
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 257}),
        ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
        ("/api/generate", {"prompt": "x", "suffix": "y"}),
        ("/api/generate", {"prompt": "x", "options": {"num_predict": 10**6}}),
        ("/api/generate", {"prompt": 3}),
    ],
)
def test_errors_have_ollamas_shape(scripted_url: str, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(scripted_url + path, json={"model": MODEL, "stream": False, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        messages = [{"role": "user", "content": "x"}]
        ollama.Client(host=scripted_url).chat(model="nope", messages=messages)
    assert e.value.status_code == 404
