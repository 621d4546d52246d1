"""Agent frameworks against the real server (uvicorn on loopback): LangChain (`langchain-openai`),
Pydantic AI (`pydantic-ai-slim[openai]`) and the OpenAI Agents SDK (`OpenAIChatCompletionsModel`),
each streamed and not, on a tools-aware chat template written here (Qwen 2.5's Hermes layout).

Forced calls (`tool_choice` naming a function, `required`) and structured output run on the
embedded SmolLM2-135M-Instruct, a real instruct model that writes plausible calls when the grammar
makes it call; calls the model chooses on its own (auto), parallel calls and the two-turn loop that
feeds a tool's result back run on a scripted model (models/scripted.py), whose script is chosen by
the last token of the last message: "weather" and "two" call, and after a tool result it answers
the JSON of `Weather`. Every test checks what the framework returns: the call's name and
arguments as the framework parsed them (and as its tool received them), the final answer, the
pydantic object. instructor's `Mode.TOOLS` (a named forced call) runs on SmolLM2 too; it is
installed by `make install` apart (see the Makefile)."""

from __future__ import annotations

import asyncio
import functools
import json
import operator
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from pydantic import BaseModel

from omlx_logprobs.models.loader import load_model
from tests.helpers.scripted import write_description
from tests.helpers.server import thread_server
from tests.integration.test_tool_calls import TEMPLATE  # Qwen 2.5's Hermes layout

SCRIPTED = "scripted-agent"
QUESTION = "What is the weather in Paris?"


class Weather(BaseModel):
    city: str
    sky: str


def hermes(*calls: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Script segments of Hermes calls, the tags one token each."""
    out: list[dict[str, Any]] = []
    for name, args in calls:
        body = json.dumps({"name": name, "arguments": args})  # non-ASCII as JSON escapes
        out += [{"tokens": ["<tool_call>"]}, {"text": f"\n{body}\n"}, {"tokens": ["</tool_call>"]}]
    return out


ANSWER = Weather(city="Paris", sky="sunny")
SCRIPTS = {
    # first: what any other last message gets (a tool's result)
    "answer": [{"text": ANSWER.model_dump_json()}],
    "weather": hermes(("get_weather", {"city": "Paris"})),
    "two": hermes(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})),
    # half an emoji's surrogate pair, as JSON escapes it: a lone surrogate once decoded
    "half": hermes(("get_weather", {"city": "Paris \ud83d"})),
}


class Server(NamedTuple):
    url: str  # the API's base URL, .../v1
    model: str  # the served model's name


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("agents") / "agent.json"
    desc = write_description(
        path, name=SCRIPTED, added_tokens=["<tool_call>", "</tool_call>"], scripts=SCRIPTS
    )
    model = load_model(str(desc))
    model.tokenizer.chat_template = TEMPLATE
    with thread_server(model, tool_format="hermes") as (url, _):
        yield Server(url + "/v1", model.name)


@pytest.fixture(scope="module")
def smol(embedded_dir: Path) -> Iterator[Server]:
    model = load_model(str(embedded_dir))
    model.tokenizer.chat_template = TEMPLATE
    with thread_server(model, tool_format="hermes") as (url, _):
        yield Server(url + "/v1", model.name)


def get_weather(city: str) -> str:
    """The weather now in a city."""
    return "sunny"


# LangChain


def chat_openai(server: Server) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=server.model,
        base_url=server.url,
        api_key="-",
        temperature=0,
        max_tokens=48,  # one call is 31 tokens
        max_retries=0,
    )


def lc_answer(llm: Any, messages: list[Any], stream: bool) -> Any:
    """The AI message, or the sum of its streamed chunks."""
    if not stream:
        return llm.invoke(messages)
    return functools.reduce(operator.add, llm.stream(messages))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_langchain_forced_call(smol: Server, choice: str, stream: bool) -> None:
    """`bind_tools(..., tool_choice=NAME or "required")`: exactly one call, get_weather with
    {"city": "Paris"}, and no text."""
    llm = chat_openai(smol).bind_tools([get_weather], tool_choice=choice)
    msg = lc_answer(llm, [("user", QUESTION)], stream)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert msg.content == ""
    assert not msg.invalid_tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_langchain_agent_loop(scripted: Server, stream: bool) -> None:
    """The model calls on its own (tool_choice auto): the parsed call; its result sent back as a
    ToolMessage; the answer after it. Two calls in one turn: both, in order."""
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_openai(scripted).bind_tools([get_weather])
    two = lc_answer(llm, [HumanMessage("Case: two")], stream)
    assert [(c["name"], c["args"]) for c in two.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c["id"] for c in two.tool_calls}) == 2
    history: list[Any] = [HumanMessage("Case: weather")]
    call = lc_answer(llm, history, stream)
    [c] = call.tool_calls
    assert (c["name"], c["args"]) == ("get_weather", {"city": "Paris"}) and call.content == ""
    history += [call, ToolMessage(get_weather(**c["args"]), tool_call_id=c["id"])]
    answer = lc_answer(llm, history, stream)
    assert not answer.tool_calls
    assert Weather.model_validate_json(answer.content) == ANSWER


# Pydantic AI


def pai_agent(server: Server, output: Any = str, tools: bool = True) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAICompatibleProvider("omlx", base_url=server.url, api_key="-")
    return Agent(
        OpenAIChatModel(server.model, provider=provider),
        output_type=output,
        tools=[get_weather] if tools else [],
        model_settings=ModelSettings(temperature=0.0, max_tokens=48),
        retries=0,
    )


def pai_run(agent: Any, prompt: str, stream: bool) -> Any:
    """(output, messages) of a run, streamed or not."""
    if not stream:
        r = agent.run_sync(prompt)
        return r.output, r.all_messages()

    async def run() -> Any:
        async with agent.run_stream(prompt) as r:
            out = await r.get_output()
            return out, r.all_messages()

    return asyncio.run(run())


def pai_calls(messages: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    from pydantic_ai.messages import ToolCallPart

    parts = [p for m in messages for p in m.parts if isinstance(p, ToolCallPart)]
    return [(p.tool_name, p.args_as_dict()) for p in parts]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pydantic_ai_agent_loop(scripted: Server, stream: bool) -> None:
    """The model calls get_weather on its own; Pydantic AI runs it, sends the result back and
    returns the answer that follows. Two calls in one turn: both run."""
    agent = pai_agent(scripted)
    out, messages = pai_run(agent, "Case: weather", stream)
    assert pai_calls(messages) == [("get_weather", {"city": "Paris"})]
    assert Weather.model_validate_json(out) == ANSWER
    out, messages = pai_run(agent, "Case: two", stream)
    assert pai_calls(messages) == [("get_weather", {"city": c}) for c in ("Paris", "Oslo")]
    assert Weather.model_validate_json(out) == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["native", "prompted"])
def test_pydantic_ai_output_beside_a_tool(scripted: Server, mode: str, stream: bool) -> None:
    """`NativeOutput` (response_format json_schema) and `PromptedOutput` (json_object) with a
    tool, tool_choice auto: the model may call the tool first, and the answer after its result
    is the pydantic object."""
    from pydantic_ai import NativeOutput, PromptedOutput

    output = NativeOutput(Weather) if mode == "native" else PromptedOutput(Weather)
    out, messages = pai_run(pai_agent(scripted, output), "Case: weather", stream)
    assert pai_calls(messages) == [("get_weather", {"city": "Paris"})]
    assert out == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pydantic_ai_native_output(smol: Server, stream: bool) -> None:
    """`NativeOutput` (response_format json_schema) on SmolLM2, no tools (given one, SmolLM2
    calls it again and again): the JSON it writes, validated into a Weather."""
    from pydantic_ai import NativeOutput

    out, messages = pai_run(pai_agent(smol, NativeOutput(Weather), tools=False), QUESTION, stream)
    assert isinstance(out, Weather) and out.city == "Paris"
    assert pai_calls(messages) == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pydantic_ai_output_tool(smol: Server, stream: bool) -> None:
    """A pydantic output type alone: Pydantic AI's output tool, forced (tool_choice required):
    one call and no text, the object the model wrote through it."""
    from pydantic_ai.messages import ModelResponse

    out, messages = pai_run(pai_agent(smol, Weather, tools=False), QUESTION, stream)
    assert isinstance(out, Weather) and out.city == "Paris"
    [response] = [m for m in messages if isinstance(m, ModelResponse)]
    assert [p.part_kind for p in response.parts] == ["tool-call"]  # one call, no text
    assert response.finish_reason == "tool_call"
    assert [name for name, _ in pai_calls(messages)] == ["final_result"]


# OpenAI Agents SDK


@pytest.fixture(scope="module")
def no_tracing() -> None:
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # nothing is exported anywhere


def sdk_run(
    server: Server, prompt: str, stream: bool, tool_choice: str | None = None
) -> tuple[Any, list[str]]:
    """A run of an agent whose get_weather tool writes down the cities it is called with (usage
    asked for when streamed); with a tool_choice, the run ends at the tool's result.
    (result, cities)"""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from openai import AsyncOpenAI

    cities: list[str] = []

    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return "sunny"

    async def run() -> Any:
        async with AsyncOpenAI(base_url=server.url, api_key="-", max_retries=0) as client:
            agent = Agent(
                name="weather",
                instructions="Answer with the tools.",
                tools=[function_tool(get_weather)],
                model=OpenAIChatCompletionsModel(model=server.model, openai_client=client),
                model_settings=ModelSettings(
                    temperature=0, max_tokens=48, tool_choice=tool_choice, include_usage=True
                ),
                tool_use_behavior="stop_on_first_tool" if tool_choice else "run_llm_again",
            )
            if not stream:
                return await Runner.run(agent, prompt, max_turns=3)
            r = Runner.run_streamed(agent, prompt, max_turns=3)
            async for _ in r.stream_events():
                pass
            return r

    return asyncio.run(run()), cities


def sdk_calls(result: Any) -> list[tuple[str, dict[str, Any]]]:
    items = [i.raw_item for i in result.new_items if i.type == "tool_call_item"]
    return [(i.name, json.loads(i.arguments)) for i in items]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_agents_sdk_agent_loop(scripted: Server, no_tracing: None, stream: bool) -> None:
    """The model calls on its own; the SDK runs the tool, sends its result back and returns the
    answer after it, with the usage of both requests (streamed: the usage chunk of
    `stream_options`). Two calls in one turn: both run."""
    result, cities = sdk_run(scripted, "Case: weather", stream)
    assert sdk_calls(result) == [("get_weather", {"city": "Paris"})] and cities == ["Paris"]
    assert Weather.model_validate_json(result.final_output) == ANSWER
    usage = result.context_wrapper.usage
    assert usage.requests == 2 and usage.input_tokens > 0 and usage.output_tokens > 0
    result, cities = sdk_run(scripted, "Case: two", stream)
    assert sdk_calls(result) == [("get_weather", {"city": c}) for c in ("Paris", "Oslo")]
    assert cities == ["Paris", "Oslo"]
    assert Weather.model_validate_json(result.final_output) == ANSWER


@pytest.mark.parametrize(
    ("choice", "stream"), [("get_weather", False), ("required", True)], ids=["named", "required"]
)
def test_agents_sdk_forced_call(smol: Server, no_tracing: None, choice: str, stream: bool) -> None:
    """`ModelSettings(tool_choice=NAME or "required")`, the run ending at the tool's result: one
    call, get_weather with {"city": "Paris"}, and no text."""
    result, cities = sdk_run(smol, QUESTION, stream, choice)
    assert [i.type for i in result.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert sdk_calls(result) == [("get_weather", {"city": "Paris"})] and cities == ["Paris"]
    assert result.final_output == "sunny"


def test_a_lone_surrogate_in_a_call(scripted: Server) -> None:
    """A call whose JSON escapes half a surrogate pair (`"Paris \\ud83d"`: valid JSON, as a model
    writes half an emoji), through the `openai` client the SDK uses: the arguments keep the
    escape, and the body is valid UTF-8 to its end. (Decoded, the string held a lone surrogate
    that UTF-8 cannot encode: a 500, and a stream cut after its 200, which the client reported
    as APIConnectionError; the Agents SDK's streamed run ended so.)"""
    import openai

    client = openai.OpenAI(base_url=scripted.url, api_key="-", max_retries=0)
    body: dict[str, Any] = {
        "model": scripted.model,
        "messages": [{"role": "user", "content": "Case: half"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "temperature": 0,
    }
    want = '{"city": "Paris \\ud83d"}'
    chunks = list(client.chat.completions.create(stream=True, **body))
    calls = [c for x in chunks for ch in x.choices for c in ch.delta.tool_calls or []]
    assert [c.function.arguments for c in calls if c.function] == [want]
    [call] = client.chat.completions.create(**body).choices[0].message.tool_calls or []
    assert call.function.arguments == want
    assert json.loads(want) == {"city": "Paris \ud83d"}
    with httpx.stream(
        "POST", scripted.url + "/chat/completions", json={**body, "stream": True}
    ) as r:
        lines = r.read().decode("utf-8").split("\n\n")  # every byte UTF-8, to the end
    assert lines[-2:] == ["data: [DONE]", ""]


# instructor


class City(BaseModel):
    city: str


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_instructor_tools_mode(smol: Server, stream: bool) -> None:
    """instructor's `Mode.TOOLS`: the response model as one function, forced by name (what ended
    in IncompleteOutputException while a forced call never ended); the object it parsed, and
    with `create_partial` the last partial streamed, equal."""
    import instructor
    import openai

    client = instructor.from_openai(
        openai.OpenAI(base_url=smol.url, api_key="-", max_retries=0), mode=instructor.Mode.TOOLS
    )
    kw: dict[str, Any] = dict(
        model=smol.model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )
    if stream:
        *_, got = client.chat.completions.create_partial(response_model=City, **kw)
    else:
        got = client.chat.completions.create(response_model=City, **kw)
    assert got.model_dump() == {"city": "Paris"}  # a streamed one is instructor's Partial[City]
