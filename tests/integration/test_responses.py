"""`/v1/responses` through the real server (uvicorn on loopback) and the real clients: the `openai`
client's `responses.create` and `responses.stream`, and the OpenAI Agents SDK's default model
(`OpenAIResponsesModel`) with a tool and a structured output, streamed and not.

Logprobs are checked against independent computations: the tiny random model's against a float32
forward pass of the whole sequence (1e-4), the scripted model's against their closed form
(tests/helpers/scripted.py); every generated token's entry exactly once, across the reasoning
item, the message and the tool-call section (the first function call's `logprobs`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from pydantic import BaseModel

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import reference_logprobs
from tests.helpers.scripted import check_entries, write_description
from tests.helpers.scripted_tools import ADDED, CASES, TOOLS, case_ids
from tests.helpers.server import assert_openai_error, thread_server
from tests.integration.test_tool_calls import TEMPLATE

MODEL = "scripted-responses"
LOGPROBS = ["message.output_text.logprobs"]
FUNCTION_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


class Weather(BaseModel):
    city: str
    sky: str


ANSWER = Weather(city="Paris", sky="sunny")
# First: what any other last message gets (a tool's result): the answer in Weather's schema.
SCRIPTS = {
    "answer": [{"text": ANSWER.model_dump_json()}],
    **{name: [seg for _, seg in CASES[name].segments] for name in ("think", "forced", "two")},
}


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("responses") / "model.json"
    write_description(path, name=MODEL, added_tokens=ADDED, scripts=SCRIPTS)
    model = load_model(str(path))
    model.tokenizer.chat_template = TEMPLATE
    return model


@pytest.fixture(scope="module")
def scripted_url(scripted_model: LoadedModel) -> Iterator[str]:
    with thread_server(scripted_model, reasoning=True, tool_format="hermes") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(scripted_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_url + "/v1", api_key="-", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tiny_url(tiny: LoadedModel) -> Iterator[str]:
    with thread_server(tiny) as (url, _):
        yield url


def all_entries(response: Any) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every entry in item order (reasoning, message, the tool-call section on the first
    call), and how many each kind of item holds."""
    out: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for item in response.model_dump()["output"]:
        if item["type"] == "reasoning":
            got = item["content"][0]["logprobs"]
        elif item["type"] == "message":
            got = item["content"][0]["logprobs"]
        else:
            got = item.get("logprobs") or []
        out += got
        counts[item["type"]] = counts.get(item["type"], 0) + len(got)
    return out, counts


def streamed_entries(events: list[Any]) -> list[dict[str, Any]]:
    """The entries the stream's deltas carried, in order."""
    kinds = (
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.function_call_arguments.delta",
    )
    out: list[dict[str, Any]] = []
    for e in events:
        if e.type in kinds:
            d = e.model_dump()
            out += d.get("logprobs") or []
    return out


# ---- the openai client ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_logprobs_equal_a_float32_forward_pass(
    tiny: LoadedModel, tiny_url: str, stream: bool
) -> None:
    """Sampled (seeded) tokens' logprobs and top 5 against one float32 forward pass of the
    prompt and the output, 1e-4; streamed deltas carry exactly their tokens' entries."""
    c = openai.OpenAI(base_url=tiny_url + "/v1", api_key="-", max_retries=0, timeout=60)
    args: dict[str, Any] = dict(
        model=tiny.name, input="The capital of France", include=LOGPROBS, top_logprobs=5,
        max_output_tokens=12, temperature=1.0,
        extra_body={"seed": 7, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    if stream:
        with c.responses.stream(**args) as s:
            events = list(s)
        r = events[-1].response  # completed, or incomplete at max_output_tokens
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert streamed_entries(events) == [x.model_dump() for x in r.output[0].content[0].logprobs]
        assert "".join(e.delta for e in deltas) == r.output_text
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type in (
            "response.completed", "response.incomplete",
        )  # fmt: skip
    else:
        r = c.responses.create(**args)
    entries = r.output[0].content[0].logprobs
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    assert len(ids) == r.usage.output_tokens
    messages = [{"role": "user", "content": "The capital of France"}]
    prompt = httpx.post(tiny_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    ref = reference_logprobs(tiny, prompt + ids)[len(prompt) - 1 : -1]
    for i, (e, tid) in enumerate(zip(entries, ids)):
        assert abs(e.logprob - ref[i, tid]) < 1e-4
        top = [int(t.token.removeprefix("token_id:")) for t in e.top_logprobs]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], ref[i, top], atol=1e-4)
        np.testing.assert_allclose(sorted(ref[i])[::-1][:5], ref[i, top], atol=1e-4)
    # the same request again gives the same tokens: stream and not agree
    again = c.responses.create(**{**args, "extra_body": {"seed": 7}})
    assert again.output_text == r.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_reasoning_content_and_a_call(
    client: openai.OpenAI, scripted_model: LoadedModel, stream: bool
) -> None:
    """A reasoning item, a message, a function call: the script's every token's entry once,
    in order, against the closed form; reasoning tokens counted in usage."""
    args: dict[str, Any] = dict(
        model=MODEL, input="Case: think", tools=FUNCTION_TOOLS, include=LOGPROBS,
        top_logprobs=3, temperature=0,
    )  # fmt: skip
    if stream:  # the raw events: the stream helper rebuilds deltas without extensions
        events = list(client.responses.create(**args, stream=True))
        r = events[-1].response
    else:
        r = client.responses.create(**args)
    case = CASES["think"]
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == case.reasoning
    assert r.output[1].content[0].text == case.content
    call = r.output[2]
    assert (call.name, json.loads(call.arguments)) == (case.calls[0][0], case.calls[0][1])
    assert call.call_id.startswith("call_") and r.status == "completed"
    ids, sections = case_ids(scripted_model, "think")
    entries, counts = all_entries(r)
    check_entries(entries, ids, 0, scripted_model.vocab, 3)
    assert counts == {s: sections.count(k) for s, k in
                      (("reasoning", "r"), ("message", "c"), ("function_call", "t"))}  # fmt: skip
    assert r.usage.output_tokens == len(ids)
    assert r.usage.output_tokens_details.reasoning_tokens == sections.count("r")
    if stream:
        assert streamed_entries(events) == entries


def test_two_calls_and_a_multi_turn_loop(client: openai.OpenAI) -> None:
    """Two calls in one turn (the tool-call section on the first), then the calls' outputs
    sent back with `previous_response_id`: the stored conversation continues; GET returns
    the stored body, DELETE forgets it."""
    r = client.responses.create(model=MODEL, input="Case: two", tools=FUNCTION_TOOLS,
                                include=LOGPROBS, temperature=0)  # fmt: skip
    calls = [i for i in r.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CASES["two"].calls
    assert len(calls[0].logprobs) == r.usage.output_tokens and not getattr(calls[1], "logprobs", 0)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
               for c in calls]  # fmt: skip
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, input=results,
                                 tools=FUNCTION_TOOLS, temperature=0)  # fmt: skip
    assert Weather.model_validate_json(r2.output_text) == ANSWER
    assert r2.previous_response_id == r.id
    # the continuation's prompt is the whole conversation, as the chat route renders it
    got = client.responses.retrieve(r2.id)
    assert got.output_text == r2.output_text and got.id == r2.id
    client.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r2.id)


def test_the_continuation_renders_the_whole_conversation(
    client: openai.OpenAI, scripted_url: str
) -> None:
    """The prompt of a `previous_response_id` continuation is what chat renders for the same
    messages: the first response's input, its calls, their outputs."""
    r = client.responses.create(model=MODEL, input="Case: forced", tools=FUNCTION_TOOLS,
                                temperature=0, instructions="Be brief.")  # fmt: skip
    call = r.output[-1]
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, input=[out],
                                 tools=FUNCTION_TOOLS, temperature=0,
                                 instructions="Be brief.")  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Case: forced"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    body = {"messages": messages, "tools": TOOLS}
    prompt = httpx.post(scripted_url + "/tokenize", json=body).json()["count"]
    assert r2.usage.input_tokens == prompt


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Case: think", max_output_tokens=3,
                                include=LOGPROBS, temperature=0)  # fmt: skip
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    entries, _ = all_entries(r)
    assert len(entries) == r.usage.output_tokens == 3


# ---- the OpenAI Agents SDK --------------------------------------------------------------------


def agent_run(url: str, prompt: str, stream: bool) -> tuple[Any, list[str]]:
    """An agent on the SDK's default model (Responses) with a tool and a structured output."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # nothing is exported anywhere
    cities: list[str] = []

    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return "sunny"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as c:
            agent = Agent(
                name="weather",
                instructions="Answer with the tools.",
                tools=[function_tool(get_weather)],
                output_type=Weather,
                model=OpenAIResponsesModel(model=MODEL, openai_client=c),
                model_settings=ModelSettings(temperature=0, max_tokens=64, top_logprobs=2),
            )
            if not stream:
                return await Runner.run(agent, prompt, max_turns=3)
            result = Runner.run_streamed(agent, prompt, max_turns=3)
            async for _ in result.stream_events():
                pass
            return result

    return asyncio.run(run()), cities


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_agents_sdk_tool_and_structured_output(scripted_url: str, stream: bool) -> None:
    """The model calls the tool (under `text.format` beside tools: a call or content in the
    schema), the SDK runs it and sends the result back, the answer parses as the output type;
    each model response carries its logprobs (ModelSettings.top_logprobs)."""
    result, cities = agent_run(scripted_url, "Case: forced", stream)
    assert cities == ["Paris"]
    assert result.final_output == ANSWER
    last = result.raw_responses[-1].output[-1]
    assert last.type == "message" and len(last.content[0].logprobs) > 0


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        (
            {
                "input": "x",
                "tool_choice": {"type": "function", "name": "nope"},
                "tools": FUNCTION_TOOLS,
            },
            "tool_choice",
        ),  # fmt: skip
        ({"input": "x", "top_logprobs": 257}, "top_logprobs"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 3}}},
            },
            "text.format",
        ),  # fmt: skip
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": 3}, "input"),
    ],
)
def test_bad_input_is_an_openai_400(scripted_url: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(scripted_url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    err = assert_openai_error(r, 400, r.json()["error"]["param"])
    assert err["param"].startswith(param), err


def test_unknown_response_is_a_404(scripted_url: str) -> None:
    r = httpx.get(scripted_url + "/v1/responses/resp_nope")
    assert_openai_error(r, 404, "response_id")
    assert httpx.delete(scripted_url + "/v1/responses/resp_nope").status_code == 404


def test_the_store_is_bounded() -> None:
    from omlx_logprobs.api.responses.store import ResponseStore, Stored

    store = ResponseStore(count=3, mib=1)
    for i in range(5):
        store.put(f"r{i}", Stored.of("{}", [{"role": "user", "content": "x"}]))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put("big", Stored.of("x" * (2 << 20), []))  # larger than the whole budget
    assert store.get("big") is None


def test_not_stored_when_store_is_false(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Case: two", store=False, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_health_reports_the_store_against_its_bounds(
    client: openai.OpenAI, scripted_url: str
) -> None:
    """/health's `responses_store`: a stored response counts, one deleted no longer does."""
    before = httpx.get(scripted_url + "/health").json()["responses_store"]
    assert before["max_responses"] == 256 and before["max_bytes"] == 64 << 20
    r = client.responses.create(model=MODEL, input="Case: two", temperature=0)
    after = httpx.get(scripted_url + "/health").json()["responses_store"]
    assert after["responses"] == before["responses"] + 1
    assert after["bytes"] > before["bytes"]
    assert httpx.delete(scripted_url + f"/v1/responses/{r.id}").status_code == 200
    assert httpx.get(scripted_url + "/health").json()["responses_store"] == before
