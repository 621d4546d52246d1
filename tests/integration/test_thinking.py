"""Reasoning through the real server and the real `openai` client, serving the scripted model:
every case streamed and not, alone and inside a batch, top_logprobs 0 and 20, each logprob
against its closed form."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.scripted import CASES, case_ids, check_entries
from tests.helpers.server import server_process

MODEL = "scripted-thinker"
OPEN = {"enable_thinking": True}  # the scripted template then ends the prompt with "<think>\n"


@pytest.fixture(scope="module")
def client(thinker: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinker + "/v1", api_key="-", max_retries=0, timeout=120)


@dataclass
class Got:
    """One answer, streamed or not, in one shape."""

    reasoning: str | None = None
    content: str = ""
    reasoning_entries: list[dict[str, Any]] = field(default_factory=list)
    content_entries: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    chunks: list[dict[str, Any]] = field(default_factory=list)  # the content chunks


def request(name: str, k: int, pad: int = 0, **kw: Any) -> dict[str, Any]:
    return dict(
        model=MODEL,
        messages=[{"role": "user", "content": "word " * pad + f"Case: {name}"}],
        temperature=0,
        logprobs=True,
        top_logprobs=k,
        extra_body={"return_token_ids": True, "flat_logprobs": False, **kw.pop("extra_body", {})},
        **kw,
    )


def from_response(r: Any) -> Got:
    d = r.model_dump()
    ch = d["choices"][0]
    lp = ch["logprobs"]
    return Got(
        ch["message"].get("reasoning_content"),
        ch["message"]["content"],
        lp["reasoning_content"],
        lp["content"],
        ch["finish_reason"],
        d["usage"],
        ch["token_ids"],
    )


def from_chunks(chunks: list[Any]) -> Got:
    got = Got()
    dicts = [c.model_dump() for c in chunks]
    first = dicts[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and first["logprobs"] is None
    for c in dicts[1:]:
        if not c["choices"]:
            got.usage = c["usage"]
            continue
        ch = c["choices"][0]
        if ch["finish_reason"] is not None:
            assert ch["logprobs"] is None and ch["delta"].get("content") is None
            got.finish = ch["finish_reason"]
            continue
        delta, lp = ch["delta"], ch["logprobs"]
        if delta.get("reasoning_content") is not None:
            got.reasoning = (got.reasoning or "") + delta["reasoning_content"]
        got.content += delta.get("content") or ""
        got.reasoning_entries += lp["reasoning_content"]
        got.content_entries += lp["content"]
        got.token_ids += ch["token_ids"]
        got.chunks.append(ch)
    return got


def check(
    got: Got,
    name: str,
    k: int,
    model: LoadedModel,
    first_step: int = 0,
    reasoning: tuple[str, str] | None = None,
) -> None:
    """All of an answer against its case; first_step: script tokens the template wrote."""
    case = CASES[name]
    ids, n_reasoning = case_ids(model, name)
    ids = ids[first_step:]
    n_reasoning -= first_step
    assert got.token_ids == ids
    want = reasoning or (case.reasoning, case.content)
    assert (got.reasoning or "", got.content) == want
    assert got.finish == "stop"
    assert got.usage["completion_tokens"] == len(ids)
    assert got.usage["completion_tokens_details"]["reasoning_tokens"] == n_reasoning
    assert len(got.reasoning_entries) == n_reasoning
    entries = got.reasoning_entries + got.content_entries
    check_entries(entries, ids, first_step, model.vocab, k)
    assert entries[-1]["token"] == "<|im_end|>" and entries[-1]["bytes"] is None
    if got.chunks:
        check_chunks(got.chunks, [model.vocab.token_bytes[t] or b"" for t in ids], first_step > 0)


def check_chunks(
    chunks: list[dict[str, Any]], raw_tokens: list[bytes], inside: bool, stop: str = ""
) -> None:
    """After every chunk, the text sent so far is exactly the text of the tokens whose entries
    have been sent, tags removed: each chunk carries whole tokens, their entries and their text.
    Only the last may end in a stop string (its tokens keep their entries, its text is cut)."""
    raw = b"".join(raw_tokens)
    tags = _tag_ranges(raw, inside)
    ends = [sum(len(t) for t in raw_tokens[: i + 1]) for i in range(len(raw_tokens))]
    text, n = b"", 0
    for i, ch in enumerate(chunks):
        for key in ("reasoning_content", "content"):
            text += (ch["delta"].get(key) or "").encode()
            n += len(ch["logprobs"][key])
        sent = _untagged(raw, tags, ends[n - 1] if n else 0)
        if stop and i == len(chunks) - 1:
            assert sent.startswith(text) and sent[len(text) :].startswith(stop.encode()), ch
        else:
            assert text == sent, ch
    assert n == len(ends)


def _tag_ranges(raw: bytes, inside: bool) -> list[range]:
    """Where the rules put the tags: <think> first (unless the prompt opened it), then the
    first </think>."""
    if not inside and not raw.startswith(b"<think>"):
        return []
    start = 0 if inside else 7
    close = raw.find(b"</think>", start)
    return [range(0, start)] + ([range(close, close + 8)] if close >= 0 else [])


def _untagged(raw: bytes, tags: list[range], end: int) -> bytes:
    return bytes(b for i, b in enumerate(raw[:end]) if not any(i in r for r in tags))


def ask(client: openai.OpenAI, stream: bool, body: dict[str, Any]) -> Got:
    if stream:
        return from_chunks(
            list(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **body
                )
            )
        )
    return from_response(client.chat.completions.create(**body))


async def aask(client: openai.AsyncOpenAI, stream: bool, body: dict[str, Any]) -> Got:
    if stream:
        it = await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **body
        )
        return from_chunks([c async for c in it])
    return from_response(await client.chat.completions.create(**body))


@pytest.mark.parametrize("k", [0, 20])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_each_case_alone(client: openai.OpenAI, scripted: LoadedModel, stream: bool, k: int):
    for name in CASES:
        check(ask(client, stream, request(name, k)), name, k, scripted)


@pytest.mark.parametrize("k", [0, 20])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_every_case_inside_one_batch(
    thinker: str, scripted: LoadedModel, stream: bool, k: int
) -> None:
    names = list(CASES) * 2
    bodies = [request(n, k, pad=i % 7) for i, n in enumerate(names)]
    # and thinking opened by the template, next to requests that open it themselves
    bodies.append(request("opened", k, extra_body={"chat_template_kwargs": OPEN}))

    async def together() -> list[Got]:
        async with openai.AsyncOpenAI(
            base_url=thinker + "/v1", api_key="-", max_retries=0, timeout=300
        ) as c:
            return await asyncio.gather(*[aask(c, stream, b) for b in bodies])

    *gots, opened = asyncio.run(together())
    for name, got in zip(names, gots):
        check(got, name, k, scripted)
    check(opened, "opened", k, scripted, first_step=2, reasoning=("inside", " out"))


@pytest.mark.parametrize("k", [0, 20])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_thinking_opened_by_the_template(
    client: openai.OpenAI, scripted: LoadedModel, stream: bool, k: int
) -> None:
    got = ask(client, stream, request("opened", k, extra_body={"chat_template_kwargs": OPEN}))
    check(got, "opened", k, scripted, first_step=2, reasoning=("inside", " out"))
    assert len(got.reasoning_entries) == 2  # "inside", "</think>"; the stop token is content


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    for name in CASES:
        a, b = (ask(client, s, request(name, 3)) for s in (False, True))
        assert (a.reasoning, a.content, a.usage) == (b.reasoning, b.content, b.usage)
        assert a.reasoning_entries == b.reasoning_entries
        assert a.content_entries == b.content_entries


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_strings_cut_the_answer_not_the_reasoning(client: openai.OpenAI, stream: bool) -> None:
    got = ask(client, stream, request("special", 2, stop=["x < y"]))
    assert got.reasoning == CASES["special"].reasoning  # holds "x < y" too
    assert got.content == "\n\nSo a<b, " and got.finish == "stop"
    # Every generated token keeps its entry, those that completed the stop string included.
    entries = got.reasoning_entries + got.content_entries
    assert [e["token"] for e in entries][-3:] == [" x", " <", " y"]
    assert len(entries) == len(got.token_ids) == got.usage["completion_tokens"]
    if stream:
        raw_tokens = [bytes(e["bytes"] or b"") for e in entries]
        check_chunks(got.chunks, raw_tokens, inside=False, stop="x < y")


def test_without_logprobs_the_text_is_still_split(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Case: bytes"}], temperature=0
    )
    choice = r.choices[0]
    assert choice.logprobs is None
    assert choice.message.model_extra["reasoning_content"] == CASES["bytes"].reasoning
    assert choice.message.content == CASES["bytes"].content
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Case: plain"}], temperature=0
    )
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_length_inside_reasoning(client: openai.OpenAI, stream: bool) -> None:
    got = ask(client, stream, request("special", 1, max_tokens=4))
    assert got.finish == "length" and got.content == "" and got.content_entries == []
    assert got.reasoning == "Let me see"
    assert [e["token"] for e in got.reasoning_entries] == ["<think>", "Let", " me", " see"]


def test_parser_none_leaves_everything_in_content(
    scripted_path: Path, scripted: LoadedModel
) -> None:
    with server_process(["--model", str(scripted_path), "--reasoning-parser", "none"]) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="-", max_retries=0, timeout=120)
        r = c.chat.completions.create(**request("special", 2))
    msg, lp = r.choices[0].message, r.choices[0].logprobs
    case = CASES["special"]
    assert msg.content == f"<think>{case.reasoning}</think>{case.content}"
    assert "reasoning_content" not in (msg.model_extra or {})
    assert "reasoning_content" not in (lp.model_extra or {})
    assert lp.content[0].token == "<think>" and lp.content[0].bytes == list(b"<think>")
    ids, _ = case_ids(scripted, "special")
    check_entries([e.model_dump() for e in lp.content], ids, 0, scripted.vocab, 2)


def test_a_model_without_think_markers_keeps_the_plain_shape(server: str) -> None:
    """The embedded SmolLM2 has no think markers: auto leaves the parser off."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
    }
    choice = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert set(choice["message"]) == {"role", "content"}
    assert set(choice["logprobs"]) == {"content", "refusal"}


def test_constrained_output_after_an_opened_think_is_refused(client: openai.OpenAI) -> None:
    """The grammar would apply to the reasoning: a 400 naming the constraint's field."""
    with pytest.raises(openai.BadRequestError) as e:
        kw = {"response_format": {"type": "json_object"}}
        client.chat.completions.create(
            **request("opened", 0, extra_body={"chat_template_kwargs": OPEN}, **kw)
        )
    assert e.value.body["param"] == "response_format"
    assert "reasoning" in e.value.body["message"]
