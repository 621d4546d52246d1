"""`/v1/messages` through the real server (uvicorn on loopback) and the real `anthropic` client:
content blocks with tools, thinking and streaming, a multi-turn tool loop, stop sequences,
`count_tokens`, the `x-api-key` header and Anthropic's error shape. The scripted model's every
logprob is known in closed form (tests/helpers/scripted.py): with this server's `logprobs`
extension every generated token's entry comes back exactly once, across the blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from omlx_logprobs.config import Access
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.scripted import check_entries
from tests.helpers.scripted_tools import CASES, TOOLS, case_ids
from tests.helpers.server import thread_server
from tests.integration.test_responses import ANSWER, MODEL, Weather, scripted_model  # noqa: F401

KEY = "sk-local-test"
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
LOGPROBS = {"logprobs": True, "top_logprobs": 3}
# anthropic 2.x's client no longer declares the sampling fields: they go in the body as sent
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(scripted_model: LoadedModel) -> Iterator[str]:  # noqa: F811
    with thread_server(scripted_model, reasoning=True, tool_format="hermes",
                       access=Access(api_key=KEY)) as (url, _):  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def entries_of(message: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Every block's entries in order, and each block's type."""
    out: list[dict[str, Any]] = []
    kinds = []
    for block in message.model_dump()["content"]:
        kinds.append(block["type"])
        out += block.get("logprobs") or []
    return out, kinds


def ask(client: anthropic.Anthropic, case: str, stream: bool, **kw: Any) -> Any:
    extra = {**GREEDY, **kw.pop("extra_body", {})}
    args: dict[str, Any] = dict(
        model=MODEL, max_tokens=96, tools=ANTHROPIC_TOOLS, extra_body=extra,
        messages=[{"role": "user", "content": f"Case: {case}"}], **kw,
    )  # fmt: skip
    if not stream:
        return client.messages.create(**args), None
    with client.messages.stream(**args) as s:
        events = list(s)
        return s.get_final_message(), events


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_thinking_text_and_tool_use(
    client: anthropic.Anthropic,
    scripted_model: LoadedModel,  # noqa: F811
    stream: bool,
) -> None:
    m, events = ask(client, "think", stream, thinking={"type": "enabled", "budget_tokens": 64},
                    extra_body=LOGPROBS)  # fmt: skip
    case = CASES["think"]
    entries, kinds = entries_of(m)
    if stream:  # the client's snapshot keeps the blocks as started: the deltas carry them
        entries = [x for e in events if e.type == "content_block_delta"
                   for x in e.model_dump().get("logprobs") or []]  # fmt: skip
    assert kinds == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == case.reasoning and m.content[1].text == case.content
    use = m.content[2]
    assert (use.name, use.input) == case.calls[0] and use.id.startswith("toolu_")
    assert m.stop_reason == "tool_use" and m.role == "assistant"
    ids, sections = case_ids(scripted_model, "think")
    check_entries(entries, ids, 0, scripted_model.vocab, 3)
    assert m.usage.output_tokens == len(ids)


def test_streamed_deltas_carry_their_tokens(
    client: anthropic.Anthropic,
    scripted_model: LoadedModel,  # noqa: F811
) -> None:
    """The raw events: message_start, blocks started, grown and stopped in order, then
    message_delta and message_stop; the deltas' entries, joined, are the whole output's."""
    raw = client.messages.create(
        model=MODEL, max_tokens=96, tools=ANTHROPIC_TOOLS, stream=True,
        messages=[{"role": "user", "content": "Case: two"}], extra_body={**LOGPROBS, **GREEDY},
    )  # fmt: skip
    events = list(raw)
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    entries = []
    for e in events:
        if e.type == "content_block_delta":
            entries += e.model_dump().get("logprobs") or []
    ids, _ = case_ids(scripted_model, "two")
    check_entries(entries, ids, 0, scripted_model.vocab, 3)
    calls = [e.content_block for e in events if e.type == "content_block_start"]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert events[-2].delta.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_multi_turn_tool_loop(client: anthropic.Anthropic, server: str, stream: bool) -> None:
    """A call, its result sent back as a tool_result block, the answer; the history renders as
    chat renders the same conversation (count_tokens = /tokenize)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Case: forced"}]
    m, _ = ask(client, "forced", stream)
    use = next(b for b in m.content if b.type == "tool_use")
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]  # fmt: skip
    args: dict[str, Any] = dict(model=MODEL, max_tokens=96, extra_body=GREEDY,
                                tools=ANTHROPIC_TOOLS, messages=history)  # fmt: skip
    if stream:
        with client.messages.stream(**args) as s:
            answer = s.get_final_message()
    else:
        answer = client.messages.create(**args)
    assert Weather.model_validate_json(answer.content[0].text) == ANSWER
    assert answer.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model=MODEL, tools=ANTHROPIC_TOOLS, messages=history)
    chat = [
        {"role": "user", "content": "Case: forced"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
    ]  # fmt: skip
    r = httpx.post(server + "/tokenize", json={"messages": chat, "tools": TOOLS},
                   headers={"x-api-key": KEY})  # fmt: skip
    u = answer.usage  # Anthropic counts the tokens read from the prefix cache apart
    assert counted.input_tokens == r.json()["count"] == u.input_tokens + u.cache_read_input_tokens


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=MODEL, max_tokens=64, stop_sequences=["sky"],
                               messages=[{"role": "user", "content": "hello"}],
                               extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "sky"
    assert m.content[0].text == '{"city":"Paris","'
    m = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "hello"}])  # fmt: skip
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_system_and_structured_output(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model=MODEL, max_tokens=64, system=[{"type": "text", "text": "Be exact."}],
        messages=[{"role": "user", "content": "hello"}],
        output_config={"format": {"type": "json_schema", "schema": Weather.model_json_schema()}},
        extra_body=GREEDY,
    )  # fmt: skip
    assert Weather.model_validate_json(m.content[0].text) == ANSWER


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "invalid_request_error",
        ),  # fmt: skip
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "bash_20250124", "name": "bash"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 99},
            400,
            "invalid_request_error",
        ),  # fmt: skip
        (
            {"max_tokens": 10**6, "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
        ),  # fmt: skip
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "wat": 1},
            400,
            "invalid_request_error",
        ),  # fmt: skip
        (
            {"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
            404,
            "not_found_error",
        ),  # fmt: skip
    ],
)
def test_errors_have_anthropics_shape(
    server: str, body: dict[str, Any], status: int, kind: str
) -> None:
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, **body},
                   headers={"x-api-key": KEY})  # fmt: skip
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


def test_the_key(server: str) -> None:
    bad = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
