"""Conversations sent back keep the ids the model sampled, through the real server and the real
clients: `openai`'s chat completions (JSON and streamed), its Responses client
(`previous_response_id` and the output items sent back as input), the OpenAI Agents SDK's
Responses model, and `anthropic`'s Messages. The tiny random model samples words whose ids are
often not their text's tokenization: for each API the second prompt begins with exactly the first
prompt's ids and the first answer's sampled ids (so the prefix cache holds all of them), usage
counts them, and an edited answer is tokenized from its text as before."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from omlx_logprobs.api.core.prompts import chat_prompt
from omlx_logprobs.api.core.protocol import ChatCompletionRequest
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.scripted import write_description
from tests.helpers.scripted_tools import ADDED, CASES
from tests.helpers.server import thread_server
from tests.helpers.tap import Tap
from tests.integration.test_tool_calls import TEMPLATE

SEEDS = range(6)
SCRIPTED = "scripted-faithful"
TOOLS_MODEL = "scripted-faithful-tools"
ODD = "Hi there, all of you"
HELLO = [{"role": "user", "content": "Hello there"}]
MORE = {"role": "user", "content": "Tell me more"}


@pytest.fixture(scope="module")
def served(tiny: LoadedModel) -> Iterator[tuple[str, Tap]]:
    with thread_server(tiny) as (url, engine):
        yield url, Tap(engine)


@pytest.fixture(scope="module")
def client(served: tuple[str, Tap]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="-", max_retries=0, timeout=120)


def plain_ids(model: LoadedModel, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as the server tokenizes a conversation it did not answer."""
    return chat_prompt(ChatCompletionRequest(model=model.name, messages=messages), model)


def retokenized(model: LoadedModel, text: str) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_sends_back_the_sampled_ids(
    client: openai.OpenAI, tiny: LoadedModel, stream: bool
) -> None:
    differed = 0
    for seed in SEEDS:
        first = client.chat.completions.create(
            model=tiny.name, messages=HELLO, max_tokens=12, seed=seed, temperature=1.0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        choice = first.choices[0]
        prompt, sampled = first.prompt_token_ids, choice.token_ids
        text = choice.message.content or ""
        messages = [*HELLO, {"role": "assistant", "content": text}, MORE]
        ids, usage = _second_chat(client, tiny.name, messages, stream)
        assert ids[: len(prompt) + len(sampled)] == prompt + sampled
        assert usage["prompt_tokens_details"]["reused_output_tokens"] == len(sampled)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompt) + len(sampled) - 1
        differed += retokenized(tiny, text) != sampled
    # the splice matters: for some answer the text's own ids are not the sampled ones
    assert differed > 0


def _second_chat(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], stream: bool
) -> tuple[list[int], dict[str, Any]]:
    body: dict[str, Any] = {"return_token_ids": True}
    if not stream:
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=2,
            extra_body=body,
        )
        return r.prompt_token_ids, r.usage.model_dump()
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, stream=True,
            stream_options={"include_usage": True}, extra_body=body,
        )
    )  # fmt: skip
    ids = chunks[0].choices[0].model_extra["prompt_token_ids"]
    return ids, chunks[-1].usage.model_dump()


def test_a_streamed_answer_is_remembered(client: openai.OpenAI, tiny: LoadedModel) -> None:
    chunks = list(
        client.chat.completions.create(
            model=tiny.name, messages=HELLO, max_tokens=10, seed=7, stream=True,
            extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    prompt = chunks[0].choices[0].model_extra["prompt_token_ids"]
    sampled = [
        t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages = [*HELLO, {"role": "assistant", "content": text}, MORE]
    ids, usage = _second_chat(client, tiny.name, messages, False)
    assert ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert usage["prompt_tokens_details"]["reused_output_tokens"] == len(sampled)


def test_an_edited_answer_is_tokenized_from_its_text(
    client: openai.OpenAI, tiny: LoadedModel
) -> None:
    first = client.chat.completions.create(
        model=tiny.name,
        messages=HELLO,
        max_tokens=12,
        seed=3,
    )
    text = first.choices[0].message.content or ""
    messages = [*HELLO, {"role": "assistant", "content": text + " (edited)"}, MORE]
    ids, usage = _second_chat(client, tiny.name, messages, False)
    assert ids == plain_ids(tiny, messages)
    assert usage["prompt_tokens_details"]["reused_output_tokens"] == 0


def test_responses_previous_id_and_items_sent_back(
    client: openai.OpenAI, served: tuple[str, Tap], tiny: LoadedModel
) -> None:
    tap = served[1]
    for seed in SEEDS[:3]:
        first = client.responses.create(
            model=tiny.name, input="Hello there", max_output_tokens=10, temperature=1.0,
            extra_body={"seed": seed},
        )  # fmt: skip
        prompt, sampled = tap.prompts[first.id], tap.sampled[first.id]
        chained = client.responses.create(
            model=tiny.name, input="Tell me more", previous_response_id=first.id,
            max_output_tokens=2,
        )  # fmt: skip
        items: list[Any] = [*HELLO, *(o.model_dump() for o in first.output), MORE]
        resent = client.responses.create(model=tiny.name, input=items, max_output_tokens=2)
        for second in (chained, resent):
            assert tap.prompts[second.id][: len(prompt) + len(sampled)] == prompt + sampled
            details = second.usage.input_tokens_details.model_dump()
            assert details["reused_output_tokens"] == len(sampled)
        assert tap.prompts[chained.id] == tap.prompts[resent.id]


@pytest.fixture(scope="module")
def scripted_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Tap]]:
    """A scripted model whose answer is one token per byte (never its text's tokenization), or
    the same text as its tokenization, and ends its turn, as the Agents SDK needs (an answer
    cut at the token limit is its error)."""
    path = tmp_path_factory.mktemp("faithful") / "model.json"
    scripts = {"odd": [{"bytes": ODD}], "even": [{"text": ODD}]}  # one text, two ways
    write_description(path, name=SCRIPTED, scripts=scripts)
    with thread_server(load_model(str(path))) as (url, engine):
        yield url, Tap(engine)


def test_the_agents_sdk_conversation_keeps_the_sampled_ids(
    scripted_url: tuple[str, Tap], tiny: LoadedModel
) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner

    url, tap = scripted_url

    async def run() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as c:
            agent = Agent(
                name="talker",
                instructions="Talk.",
                model=OpenAIResponsesModel(model=SCRIPTED, openai_client=c),
                model_settings=ModelSettings(max_tokens=32, temperature=0),
            )
            first = await Runner.run(agent, "Case: odd")
            again = [*first.to_input_list(), {"role": "user", "content": "Again: odd"}]
            return first, await Runner.run(agent, again)

    first, second = asyncio.run(run())
    assert first.final_output == ODD
    one, two = first.raw_responses[0].response_id, second.raw_responses[0].response_id
    prompt, sampled = tap.prompts[one], tap.sampled[one]
    assert len(sampled) == len(ODD) + 1  # a token per byte, and the end of the turn
    assert retokenized(tiny, ODD) != sampled[:-1]  # (the same tokenizer: SmolLM2's)
    assert tap.prompts[two][: len(prompt) + len(sampled)] == prompt + sampled
    assert second.raw_responses[0].usage.input_tokens_details.cached_tokens >= len(prompt)


@pytest.fixture(scope="module")
def tools_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Tap]]:
    """The tool-call tests' scripted model (Hermes calls, a template that writes them back as
    the model wrote them): a forced call, then an answer to the tool's result."""
    path = tmp_path_factory.mktemp("faithful-tools") / "model.json"
    scripts = {name: [seg for _, seg in CASES[name].segments] for name in ("answer", "forced")}
    write_description(path, name=TOOLS_MODEL, added_tokens=ADDED, scripts=scripts)
    model = load_model(str(path))
    model.tokenizer.chat_template = TEMPLATE
    with thread_server(model, tool_format="hermes") as (url, engine):
        yield url, Tap(engine)


def test_an_agent_loop_keeps_its_tool_call(tools_url: tuple[str, Tap]) -> None:
    """The Agents SDK runs the tool the model called and sends the call back with its result:
    the answer's prompt begins with the call's prompt and its sampled ids."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    url, tap = tools_url

    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return "sunny"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as c:
            agent = Agent(
                name="weather",
                instructions="Answer with the tools.",
                tools=[function_tool(get_weather)],
                model=OpenAIResponsesModel(model=TOOLS_MODEL, openai_client=c),
                model_settings=ModelSettings(max_tokens=64, temperature=0),
            )
            return await Runner.run(agent, "Case: forced", max_turns=3)

    result = asyncio.run(run())
    assert result.final_output == CASES["answer"].content
    call, answer = (r.response_id for r in result.raw_responses)
    prompt, sampled = tap.prompts[call], tap.sampled[call]
    assert tap.prompts[answer][: len(prompt) + len(sampled)] == prompt + sampled
    assert result.raw_responses[1].usage.input_tokens_details.cached_tokens >= len(prompt)


def test_a_response_id_finds_its_own_answer(scripted_url: tuple[str, Tap]) -> None:
    """The same text sampled two ways: the text finds the latest answer's ids, a continuation
    by `previous_response_id` those of the response it names."""
    url, tap = scripted_url
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    kw: dict[str, Any] = {"model": SCRIPTED, "temperature": 0, "max_output_tokens": 32}
    odd = client.responses.create(input="Case: odd", **kw)
    even = client.responses.create(input="Case: even", **kw)
    assert odd.output_text == even.output_text == ODD
    assert tap.sampled[odd.id] != tap.sampled[even.id]
    # (its own answer is the text's tokenization again: the latest answer of the text stays so)
    chained = client.responses.create(input="More: even", previous_response_id=odd.id, **kw)
    prompt, sampled = tap.prompts[odd.id], tap.sampled[odd.id]
    assert tap.prompts[chained.id][: len(prompt) + len(sampled)] == prompt + sampled
    resent = [{"role": "user", "content": "Case: odd"}, {"role": "assistant", "content": ODD}]
    again = [*resent, {"role": "user", "content": "More: even"}]
    by_text = client.responses.create(input=again, **kw)
    latest = tap.prompts[even.id] + tap.sampled[even.id]
    assert tap.prompts[by_text.id][len(prompt) : len(latest)] == tap.sampled[even.id]


# ChatML that writes an earlier answer's reasoning back as the model wrote it, and one that
# drops it (as Qwen3's does for turns before the last user message).
KEEPS_REASONING = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>' + m.reasoning_content + '</think>' }}{%- endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
DROPS_REASONING = KEEPS_REASONING.replace("m.reasoning_content %", "false %")


@pytest.mark.parametrize("keeps", [True, False], ids=["kept", "dropped"])
def test_reasoning_comes_back_where_the_template_writes_it(tmp_path: Path, keeps: bool) -> None:
    """With the thinking parser on, the answer's reasoning and content come back apart; a
    template that writes them as sampled gets the sampled ids (the think tags included), one
    that drops the reasoning gets the text's tokenization."""
    model = load_model(str(write_description(tmp_path / "thinker.json")))
    model.tokenizer.chat_template = KEEPS_REASONING if keeps else DROPS_REASONING
    with thread_server(model, reasoning=True) as (url, engine):
        tap = Tap(engine)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Case: special"}]
        kw: dict[str, Any] = {"model": model.name, "temperature": 0, "max_tokens": 64}
        first = client.chat.completions.create(messages=ask, **kw)
        said = first.choices[0].message
        reasoning = said.model_extra["reasoning_content"]
        assert reasoning and said.content
        back = {"role": "assistant", "content": said.content, "reasoning_content": reasoning}
        messages = [*ask, back, {"role": "user", "content": "Again: special"}]
        second = client.chat.completions.create(messages=messages, **kw)
    prompt, sampled = tap.prompts[first.id], tap.sampled[first.id]
    reused = second.usage.prompt_tokens_details.model_dump()["reused_output_tokens"]
    if keeps:
        assert tap.prompts[second.id][: len(prompt) + len(sampled)] == prompt + sampled
        assert reused == len(sampled)
    else:
        assert tap.prompts[second.id] == plain_ids(model, messages) and reused == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_anthropic_messages_send_back_the_sampled_ids(
    served: tuple[str, Tap], tiny: LoadedModel, stream: bool
) -> None:
    url, tap = served
    client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    for seed in SEEDS[:3]:
        kw: dict[str, Any] = {"model": tiny.name, "max_tokens": 10, "extra_body": {"seed": seed}}
        if stream:
            with client.messages.stream(messages=HELLO, **kw) as s:
                first = s.get_final_message()
        else:
            first = client.messages.create(messages=HELLO, **kw)
        prompt, sampled = tap.prompts[first.id], tap.sampled[first.id]
        back = [b.model_dump() for b in first.content]
        messages: Any = [*HELLO, {"role": "assistant", "content": back}, MORE]
        second = client.messages.create(model=tiny.name, max_tokens=2, messages=messages)
        assert tap.prompts[second.id][: len(prompt) + len(sampled)] == prompt + sampled
        assert second.usage.model_dump()["reused_output_tokens"] == len(sampled)
        counted = client.messages.count_tokens(model=tiny.name, messages=messages)
        assert counted.input_tokens == len(tap.prompts[second.id])


def test_ollama_chat_sends_back_the_sampled_ids(served: tuple[str, Tap], tiny: LoadedModel) -> None:
    url, tap = served

    def chat(messages: list[dict[str, Any]], n: int) -> tuple[dict[str, Any], str]:
        body = {"model": tiny.name, "messages": messages, "stream": False,
                "options": {"seed": 2, "num_predict": n}}  # fmt: skip
        r = httpx.post(url + "/api/chat", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json(), list(tap.prompts)[-1]

    first, one = chat(HELLO, 10)
    _, two = chat([*HELLO, first["message"], MORE], 2)
    prompt, sampled = tap.prompts[one], tap.sampled[one]
    assert tap.prompts[two][: len(prompt) + len(sampled)] == prompt + sampled


def test_health_reports_the_store(
    served: tuple[str, Tap], client: openai.OpenAI, tiny: LoadedModel
) -> None:
    client.chat.completions.create(model=tiny.name, messages=HELLO, max_tokens=2)
    report = httpx.get(served[0] + "/health", timeout=10).json()["sampled_store"]
    assert report["answers"] > 0 and 0 < report["bytes"] <= report["max_bytes"]
    assert report["max_answers"] == 4096


def test_faithful_answers_0_tokenizes_every_turn_from_its_text(tiny: LoadedModel) -> None:
    """`--faithful-answers 0`: nothing remembered, a conversation sent back is its text's ids."""
    with thread_server(tiny, faithful_answers=0) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        for seed in SEEDS:
            first = client.chat.completions.create(
                model=tiny.name, messages=HELLO, max_tokens=12, seed=seed, temperature=1.0
            )
            messages = [*HELLO, {"role": "assistant", "content": first.choices[0].message.content}]
            ids, usage = _second_chat(client, tiny.name, [*messages, MORE], False)
            assert ids == plain_ids(tiny, [*messages, MORE])
            assert usage["prompt_tokens_details"]["reused_output_tokens"] == 0
        report = httpx.get(url + "/health", timeout=10).json()["sampled_store"]
        assert (report["answers"], report["bytes"], report["max_answers"]) == (0, 0, 0)
