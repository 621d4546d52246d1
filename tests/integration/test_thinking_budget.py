"""Thinking budgets through the real server (`serve --reasoning-budgets`) and the real clients,
on the scripted reasoning model's "open" script, whose reasoning never closes by itself: with a
budget of N, N reasoning tokens, the model's own `</think>` forced (its entry marked
`"forced": true`), then the script's later tokens as the answer."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from omlx_logprobs.logprobs.columnar import decode_block
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.scripted import case_ids
from tests.helpers.server import thread_server

MODEL = "scripted-thinker"
MESSAGES = [{"role": "user", "content": "Case: open"}]


@pytest.fixture(scope="module")
def url(thinker: str) -> str:
    """The scripted model's server that test_thinking shares (conftest.py), its
    --reasoning-budgets low=2,medium=4."""
    return thinker


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)


def expected(model: LoadedModel, n: int, opened: bool = False) -> tuple[str, str, list[int]]:
    """(reasoning, content, output ids) of the "open" script under a budget of n. `opened`:
    the template wrote "<think>\n" (enable_thinking), which takes the script's first two
    steps, and reasoning counts from the first output token."""
    ids, _ = case_ids(model, "open")  # <think>, the reasoning's tokens, <|im_end|>
    close = model.tokenizer.convert_tokens_to_ids("</think>")
    first = 2 if opened else 1  # the first reasoning token's step

    def text(part: list[int]) -> str:
        return b"".join(model.vocab.token_bytes[t] or b"" for t in part).decode()

    out = [*ids[first - 1 if not opened else 2 : first + n], close, *ids[first + n + 1 :]]
    return text(ids[first : first + n]), text(ids[first + n + 1 : -1]), out


@pytest.mark.parametrize("n", [0, 3])
def test_chat_thinking_token_budget(client: openai.OpenAI, scripted: LoadedModel, n: int) -> None:
    reasoning, content, ids = expected(scripted, n)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
        extra_body={"thinking_token_budget": n, "return_token_ids": True},
    )  # fmt: skip
    d = r.model_dump()
    ch = d["choices"][0]
    assert ch["message"]["reasoning_content"] == (reasoning or None)
    assert ch["message"]["content"] == content
    assert ch["token_ids"] == ids
    assert d["usage"]["completion_tokens_details"]["reasoning_tokens"] == n + 2  # tags too
    entries = ch["logprobs"]["content"]  # flat: every token's entry in order
    assert [i for i, e in enumerate(entries) if e.get("forced")] == [1 + n]
    assert entries[1 + n]["token"] == "</think>"
    assert entries[1 + n]["logprob"] < -20  # the model's own: far from what it would sample


def test_streamed_and_effort_budget(client: openai.OpenAI, scripted: LoadedModel) -> None:
    """`reasoning_effort: low` takes the server's budget (2); streamed deltas carry the
    forced entry marked in `reasoning_content`'s logprobs (flat_logprobs off)."""
    reasoning, content, _ = expected(scripted, 2)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, logprobs=True, stream=True,  # type: ignore[arg-type]
            reasoning_effort="low", extra_body={"flat_logprobs": False},
        )
    )  # fmt: skip
    got_r = got_c = ""
    marked: list[dict[str, Any]] = []
    for c in chunks:
        d = c.model_dump()
        for ch in d["choices"]:
            got_r += ch["delta"].get("reasoning_content") or ""
            got_c += ch["delta"].get("content") or ""
            lp = ch.get("logprobs") or {}
            marked += [e for e in lp.get("reasoning_content") or [] if e.get("forced")]
    assert (got_r, got_c) == (reasoning, content)
    assert [e["token"] for e in marked] == ["</think>"]


def test_explicit_budget_wins_and_medium(client: openai.OpenAI, scripted: LoadedModel) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        reasoning_effort="medium",  # type: ignore[arg-type]
    )
    assert r.choices[0].message.content == expected(scripted, 4)[1]
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, reasoning_effort="medium",  # type: ignore[arg-type]
        extra_body={"thinking_token_budget": 1},
    )  # fmt: skip
    assert r.choices[0].message.content == expected(scripted, 1)[1]
    # no budget: the script runs unclosed, all reasoning
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == ""


def test_columnar_block_names_the_forced_position(url: str, scripted: LoadedModel) -> None:
    for fmt in ("columnar", "base64"):
        body = {
            "model": MODEL, "messages": MESSAGES, "temperature": 0, "logprobs": True,
            "thinking_token_budget": 2, "logprobs_format": fmt, "flat_logprobs": True,
        }  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        block = decode_block(r.json()["choices"][0]["logprobs"]["content"])
        assert block.forced == (3,)
        assert block.token_ids.tolist() == expected(scripted, 2)[2]


@pytest.mark.parametrize("bad", [2.0, "2", True, -2])
def test_a_budget_that_is_no_int_is_a_400(url: str, bad: Any) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "thinking_token_budget": bad}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith("thinking_token_budget")


def test_responses_reasoning_effort(client: openai.OpenAI, scripted: LoadedModel) -> None:
    reasoning, content, _ = expected(scripted, 2)
    r = client.responses.create(
        model=MODEL, input="Case: open", temperature=0, reasoning={"effort": "low"}
    )
    assert r.output_text == content
    texts = [c.text for item in r.output if item.type == "reasoning" for c in item.content or []]
    assert "".join(texts) == reasoning


def test_anthropic_budget_tokens(url: str, scripted: LoadedModel) -> None:
    reasoning, content, _ = expected(scripted, 3, opened=True)  # thinking enabled: opened
    c = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=60)
    m = c.messages.create(
        model=MODEL, max_tokens=64, messages=MESSAGES, extra_body={"temperature": 0},  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 3},
    )  # fmt: skip
    blocks = {b.type: b for b in m.content}
    assert blocks["thinking"].thinking == reasoning  # type: ignore[union-attr]
    assert blocks["text"].text == content  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_think_level(url: str, scripted: LoadedModel, stream: bool) -> None:
    reasoning, content, _ = expected(scripted, 2, opened=True)  # low=2; think opens it
    c = ollama.Client(host=url)
    parts = c.chat(
        model=MODEL, messages=MESSAGES, think="low", stream=stream, options={"temperature": 0}
    )
    parts = list(parts) if stream else [parts]
    thinking = "".join(p.message.thinking or "" for p in parts)
    text = "".join(p.message.content or "" for p in parts)
    assert (thinking, text) == (reasoning, content)


def test_budget_on_a_model_without_reasoning_is_a_400(scripted: LoadedModel) -> None:
    """A server that parses no reasoning (--reasoning-parser none): vLLM's answer to a budget
    without a reasoning config; an effort's budget there is none (the effort is answered)."""
    with thread_server(scripted, reasoning=False) as (base, _):
        body = {"model": MODEL, "messages": MESSAGES, "thinking_token_budget": 4}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "thinking_token_budget"
        body = {"model": MODEL, "messages": MESSAGES, "reasoning_effort": "low"}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"input": "Case: open", "include": ["message.output_text.logprobs"],
                           "reasoning": {"effort": "low"}}),
        ("/v1/messages", {"max_tokens": 64, "messages": MESSAGES, "logprobs": True,
                          "thinking": {"type": "enabled", "budget_tokens": 2}}),
        ("/api/chat", {"messages": MESSAGES, "think": "low", "logprobs": True, "stream": False,
                       "options": {"temperature": 0}}),
    ],
)  # fmt: skip
def test_every_api_marks_the_forced_entry(url: str, path: str, body: dict[str, Any]) -> None:
    """The one forced </think> of each answer is marked once, in that API's entries."""
    body = {"model": MODEL, "temperature": 0, **body}
    if path == "/api/chat":
        del body["temperature"]
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.text.count('"forced":true') == 1
    at = r.text.index('"forced":true')
    assert '"token":"</think>"' in r.text[r.text.rfind("{", 0, at) : at]
