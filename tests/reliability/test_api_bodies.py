"""Bad bodies on the Responses, Anthropic and Ollama routes: every field of a valid body (at
every depth) replaced by values of the wrong type or shape, streamed and not; each answer is
the API's own error shape with a 4xx, or a success, never a 5xx or a broken stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.scripted_tools import TOOLS
from tests.helpers.server import thread_server
from tests.integration.test_responses import MODEL, scripted_model  # noqa: F401

ODD: list[Any] = [None, -1, "x", [{}], {"type": 1}, True, "\ud800", 10**30]
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {
        "model": MODEL, "tools": [FN], "tool_choice": "auto", "max_output_tokens": 4,
        "input": [{"role": "user", "content": "hi"},
                  {"type": "function_call", "call_id": "c", "name": "get_weather",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "x"}],
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    },
    "/v1/messages": {
        "model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"c": "x"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "r"}]}]},
        ],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 5},
        "stop_sequences": ["x"],
    },
    "/api/chat": {
        "model": MODEL, "tools": TOOLS, "format": "json", "think": True, "logprobs": True,
        "top_logprobs": 2, "options": {"num_predict": 4, "temperature": 0.5, "stop": ["x"]},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "x"}}}]},
            {"role": "tool", "content": "r", "tool_name": "get_weather"},
        ],
    },
    "/api/generate": {"model": MODEL, "prompt": "hi", "system": "s", "logprobs": True,
                      "options": {"num_predict": 4}},
}  # fmt: skip


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    if isinstance(obj, dict):
        items: Any = obj.items()
    else:
        items = enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from paths(v, (*prefix, k))


def replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = json.loads(json.dumps(obj))
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def url(scripted_model: LoadedModel) -> Iterator[str]:  # noqa: F811
    # A short context: a body whose token limit is replaced by none (Ollama's `options: null`,
    # a null max_output_tokens) generates to the end of the context: 67 s at the model's own,
    # 42 s at 512, 39 s at 192 (/v1/responses at the model's 4,096 tokens: 80 s). The routes
    # bound a request by the served context, the engine config's max_model_len where it is below
    # the model's (api/core/served.py holds the model's context at it); 320 holds the longest
    # body's prompt (/api/chat's, with its tools: 279 tokens).
    cfg = EngineConfig(max_num_seqs=64, prefill_chunk=64, max_model_len=320)
    with thread_server(scripted_model, cfg, reasoning=True, tool_format="hermes") as (base, _):
        yield base


def shaped(route: str, r: httpx.Response) -> bool:
    body = r.json()
    if route.startswith("/v1/messages"):
        return body.get("type") == "error" and set(body["error"]) == {"type", "message"}
    if route.startswith("/api/"):
        return set(body) == {"error"}
    return set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("route", list(BODIES))
def test_no_body_is_a_server_error(url: str, route: str) -> None:
    base = BODIES[route]
    # A generous timeout: a body with no token limit generates to the context's end
    with httpx.Client(base_url=url, timeout=300) as c:
        for stream in (False, True):
            assert c.post(route, json={**base, "stream": stream}).status_code == 200
        for path in paths(base):
            for value in ODD:
                for stream in (False, True):
                    body = {**replaced(base, path, value), "stream": stream}
                    text = json.dumps(body)  # a lone surrogate as JSON escapes it
                    r = c.post(route, content=text, headers={"content-type": "application/json"})
                    assert r.status_code < 500, (path, value, stream, r.text)
                    if r.status_code >= 400:
                        assert shaped(route, r), (path, value, r.text)
                    else:
                        r.read()  # a stream that starts ends whole
