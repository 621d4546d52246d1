"""Tool calls through the real server and the real `openai` client: the scripted model with a
tools-aware chat template written here (Qwen 2.5's layout: tools in the system turn, calls as
`<tool_call>` JSON, results as `<tool_response>`), the format read off that template. Every case
streamed and not, the client's own stream accumulation and `parse`, multi-turn history, and
every generated token's id and logprob exactly once across reasoning, content and tool calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.parsing.thinking import ReasoningParser, parser_enabled
from omlx_logprobs.parsing.tools import ToolCallFormat, resolve_format
from omlx_logprobs.types import HARMONY_REASONING
from tests.helpers.scripted import expected
from tests.helpers.scripted_tools import CASES, HERMES, TOOLS, case_ids, write_tools_description
from tests.helpers.server import assert_openai_error, server_process, thread_server

MODEL = "scripted-tools"
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and"
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name":'
    ' <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}"
    "{%- endif %}{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    model = load_model(str(write_tools_description(tmp_path_factory.mktemp("t") / "tools.json")))
    model.tokenizer.chat_template = TEMPLATE
    return model


@pytest.fixture(scope="module")
def base(tooled: LoadedModel) -> Iterator[str]:
    tok = tooled.tokenizer
    fmt = resolve_format(ToolCallFormat.AUTO, tok)
    assert fmt is ToolCallFormat.HERMES  # read off the template
    reasoning = parser_enabled(ReasoningParser.AUTO, tok)
    with thread_server(tooled, reasoning=reasoning, tool_format=fmt.value) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)


def request(name: str, k: int = 3, **kw: Any) -> dict[str, Any]:
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "flat_logprobs": False}
    return dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"Case: {name}"}],
        tools=TOOLS,
        temperature=0,
        logprobs=True,
        top_logprobs=k,
        extra_body={**extra, **kw.pop("extra_body", {})},
        **kw,
    )


@dataclass
class Got:
    content: str | None = None
    reasoning: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    token_ids: list[int] = field(default_factory=list)
    entries: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"reasoning_content": [], "content": [], "tool_calls": []}
    )


def from_response(r: Any) -> Got:
    ch = r.model_dump()["choices"][0]
    msg, lp = ch["message"], ch["logprobs"]
    got = Got(msg["content"], msg.get("reasoning_content"), msg["tool_calls"] or [])
    got.finish, got.token_ids = ch["finish_reason"], ch["token_ids"]
    for key in got.entries:
        got.entries[key] = lp[key]
    return got


def from_chunks(chunks: list[Any]) -> Got:
    """Text, calls and entries joined over the chunks; each chunk's entries are exactly its
    tokens, in order: reasoning, then content, then tool calls."""
    got = Got(content="")
    for c in chunks[1:]:
        ch = c.model_dump()["choices"][0]
        if ch["finish_reason"] is not None:
            assert ch["logprobs"] is None and not ch["delta"].get("tool_calls")
            got.finish = ch["finish_reason"]
            continue
        delta, lp = ch["delta"], ch["logprobs"]
        got.content += delta.get("content") or ""
        if delta.get("reasoning_content") is not None:
            got.reasoning = (got.reasoning or "") + delta["reasoning_content"]
        for call in delta.get("tool_calls") or []:
            assert call["index"] == len(got.calls)  # each call whole, in one delta
            got.calls.append({k: v for k, v in call.items() if k != "index"})
        chunk_ids = []
        for key in got.entries:
            got.entries[key] += lp[key]
            chunk_ids += ids_of(lp[key])
        assert chunk_ids == ch["token_ids"]
        got.token_ids += ch["token_ids"]
    return got


def ids_of(entries: list[dict[str, Any]]) -> list[int]:
    return [int(e["token"].removeprefix("token_id:")) for e in entries]


def check(got: Got, name: str, model: LoadedModel, stream: bool) -> None:
    case = CASES[name]
    ids, sections = case_ids(model, name)
    assert got.token_ids == ids
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.calls]
    assert calls == case.calls
    for c in got.calls:  # Mistral's templates take nine alphanumerics
        shape = r"[A-Za-z0-9]{9}" if case.fmt == "mistral" else r"call_[0-9a-f]{24}"
        assert c["type"] == "function" and re.fullmatch(shape, c["id"]), c["id"]
    assert len({c["id"] for c in got.calls}) == len(got.calls)
    if stream:
        assert got.content == case.content
    else:  # null, as OpenAI writes it, when the message is only calls
        assert got.content == (case.content or (None if case.calls else ""))
    assert (got.reasoning or "") == case.reasoning
    assert got.finish == ("tool_calls" if case.calls else "stop")
    # every generated token exactly once: reasoning, content, tool calls, in that order
    e = got.entries
    every = e["reasoning_content"] + e["content"] + e["tool_calls"]
    assert ids_of(every) == ids
    assert [len(e[k]) for k in e] == [sections.count(s) for s in "rct"]
    for step, (entry, tid) in enumerate(zip(every, ids)):
        assert abs(entry["logprob"] - expected(step, tid, len(model.vocab)).logprob) < 2e-5


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_every_case(client: openai.OpenAI, tooled: LoadedModel, stream: bool) -> None:
    for name in HERMES:
        if stream:
            got = from_chunks(list(client.chat.completions.create(stream=True, **request(name))))
        else:
            got = from_response(client.chat.completions.create(**request(name)))
        check(got, name, tooled, stream)


@pytest.mark.parametrize("fmt", ["mistral", "llama3_json", "qwen3_coder"])
def test_every_other_format(tooled: LoadedModel, fmt: str) -> None:
    """The other formats' cases (calls, two calls, malformed calls as content, a call after
    reasoning) through the real server (`--tool-call-parser` FORMAT) and client, streamed and
    not, as the Hermes cases above."""
    with thread_server(tooled, reasoning=True, tool_format=fmt) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        names = [n for n, case in CASES.items() if case.fmt == fmt]
        assert len(names) >= 2
        for name in names:
            check(from_response(c.chat.completions.create(**request(name))), name, tooled, False)
            chunks = list(c.chat.completions.create(stream=True, **request(name)))
            check(from_chunks(chunks), name, tooled, True)


def test_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    for name in HERMES:
        one = from_response(client.chat.completions.create(**request(name, 5)))
        many = from_chunks(list(client.chat.completions.create(stream=True, **request(name, 5))))
        assert many.entries == one.entries
        assert [c["function"] for c in many.calls] == [c["function"] for c in one.calls]


def test_the_clients_stream_helper_accumulates_the_calls(client: openai.OpenAI) -> None:
    for name in ("weather", "two", "think"):
        body = request(name)
        with client.chat.completions.stream(**body) as s:
            events = [e.type for e in s]
            final = s.get_final_completion()
        msg = final.choices[0].message
        got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        assert got == CASES[name].calls
        assert "tool_calls.function.arguments.done" in events
        assert final.choices[0].finish_reason == "tool_calls"


class GetWeather(BaseModel):
    city: str


def test_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Case: weather"}],
        tools=[tool],
        temperature=0,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetWeather(city="Paris")


def rendered(model: LoadedModel, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    """The prompt as the tokenizer's own template writes it (arguments as objects)."""
    text = model.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def test_a_conversation_with_calls_and_results(
    client: openai.OpenAI, base: str, tooled: LoadedModel
) -> None:
    first = client.chat.completions.create(**request("weather"))
    msg = first.choices[0].message
    [call] = msg.tool_calls
    history = [
        {"role": "user", "content": "Case: weather"},
        {
            "role": "assistant",
            "content": msg.content,
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(**{**request("answer"), "messages": history})
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].message.tool_calls is None
    # the template saw the tools, the call (arguments as an object) and the result
    want_messages = [
        history[0],
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        history[2],
    ]
    want = rendered(tooled, want_messages, TOOLS)
    prompt = r.model_dump()["prompt_token_ids"]
    assert prompt == want
    text = tooled.tokenizer.decode(prompt)
    assert '"name": "get_weather"' in text and "<tool_response>\n18 C, sunny" in text
    assert '"arguments": {"city": "Paris"}' in text
    # tools inside chat_template_kwargs are the request's tools
    body = {**request("answer"), "messages": history}
    body["extra_body"] = {**body["extra_body"], "chat_template_kwargs": {"tools": TOOLS}}
    del body["tools"]
    again = client.chat.completions.create(**body)
    assert again.model_dump()["prompt_token_ids"] == want
    # both at once: a 400, as any template keyword that shadows a parameter
    r = httpx.post(
        base + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": history,
            "tools": TOOLS,
            "chat_template_kwargs": {"tools": TOOLS},
        },
    )
    assert_openai_error(r, 400, "chat_template_kwargs")
    # and /tokenize renders the same
    tok = httpx.post(base + "/tokenize", json={"messages": history, "tools": TOOLS}).json()
    assert tok["tokens"] == want


def test_tool_choice(client: openai.OpenAI, base: str, tooled: LoadedModel) -> None:
    r = client.chat.completions.create(**request("weather", tool_choice="none"))
    ch = r.model_dump()["choices"][0]
    assert ch["message"]["tool_calls"] is None and ch["finish_reason"] == "stop"
    assert ch["message"]["content"].startswith("Let me check.<tool_call>\n{")
    assert "tool_calls" not in ch["logprobs"]
    ids, _ = case_ids(tooled, "weather")
    assert ids_of(ch["logprobs"]["content"]) == ids
    url = base + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Case: weather"}]}
    named = {"type": "function", "function": {"name": "nope"}}
    r = httpx.post(url, json={**body, "tools": TOOLS, "tool_choice": named})
    assert "nope" in assert_openai_error(r, 400, "tool_choice")["message"]
    assert_openai_error(
        httpx.post(url, json={**body, "tool_choice": "required"}), 400, "tool_choice"
    )
    r = httpx.post(url, json={**body, "tools": [{"type": "function", "function": {}}]})
    assert_openai_error(r, 400, "tools[0].function.name")


def test_a_stop_string_and_max_tokens_inside_a_call(client: openai.OpenAI) -> None:
    # cut before its closing tag: still a call
    got = from_response(client.chat.completions.create(**request("weather", stop=["\n</tool"])))
    assert [c["function"]["name"] for c in got.calls] == ["get_weather"]
    assert got.finish == "tool_calls" and got.content == "Let me check."
    # cut inside its JSON: content, as written
    got = from_response(client.chat.completions.create(**request("weather", max_tokens=8)))
    assert got.calls == [] and got.finish == "length"
    assert got.content is not None and got.content.startswith("Let me check.<tool_call>\n{")
    assert ids_of(got.entries["content"]) == got.token_ids and got.entries["tool_calls"] == []


def test_parallel_calls_off_ends_at_the_first_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**request("two", parallel_tool_calls=False))
    got = from_response(r)
    assert [c["function"]["name"] for c in got.calls] == ["get_weather"]
    assert got.finish == "tool_calls"
    assert ids_of(got.entries["tool_calls"]) == got.token_ids  # nothing after the call


def test_no_format_no_tools(tooled: LoadedModel) -> None:
    """A server that parses no format refuses `tools` (auto) instead of ignoring them."""
    with thread_server(tooled) as (url, _):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Case: weather"}]}
        r = httpx.post(url + "/v1/chat/completions", json={**body, "tools": TOOLS})
        assert "--tool-call-parser" in assert_openai_error(r, 400, "tools")["message"]
        r = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200


def test_the_serve_command_with_a_named_parser(tmp_path: Path) -> None:
    """`--tool-call-parser` on the command line, the engine in its own process: calls and
    their entries cross the process boundary."""
    path = write_tools_description(tmp_path / "tools.json")
    args = ["--model", str(path), "--tool-call-parser", "hermes", "--log-level", "warning"]
    with server_process(args) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="-", max_retries=0, timeout=120)
        model = load_model(str(path))
        for stream in (False, True):
            if stream:
                got = from_chunks(list(c.chat.completions.create(stream=True, **request("two"))))
            else:
                got = from_response(c.chat.completions.create(**request("two")))
            check(got, "two", model, stream)


def test_harmony(tooled: LoadedModel) -> None:
    """gpt-oss's messages: the analysis message is reasoning, the final message content, a
    message to functions.NAME a call; headers and end markers are in no text, their tokens'
    entries where they fall."""
    with thread_server(
        tooled, reasoning=True, tool_format="harmony", reasoning_tags=HARMONY_REASONING
    ) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        for stream in (False, True):
            for name, tools in (("final", False), ("call", True)):
                body = request(name)
                if not tools:
                    del body["tools"]
                if stream:
                    got = from_chunks(list(c.chat.completions.create(stream=True, **body)))
                else:
                    got = from_response(c.chat.completions.create(**body))
                check(got, name, tooled, stream)
        # tool_choice none: the call's message stays text, its headers too
        r = c.chat.completions.create(**request("call", tool_choice="none"))
        msg = r.choices[0].message
        assert msg.tool_calls is None and msg.content.startswith("On it.<|start|>assistant")


def test_the_compact_form_has_a_tool_calls_block(client: openai.OpenAI, tooled: LoadedModel):
    one = from_response(client.chat.completions.create(**request("think")))
    body = request("think", extra_body={"logprobs_format": "columnar"})
    lp = client.chat.completions.create(**body).model_dump(warnings=False)["choices"][0]["logprobs"]
    assert lp["format"] == "columnar"
    blocks = [lp[k] for k in ("reasoning_content", "content", "tool_calls")]
    assert sum((b["token_ids"] for b in blocks), []) == one.token_ids
    every = sum((one.entries[k] for k in one.entries), [])
    assert sum((b["logprobs"] for b in blocks), []) == [e["logprob"] for e in every]
