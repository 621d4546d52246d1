"""Where tool calls end, through the real server and the `openai` client: a forced call ends the
turn once complete (a token that does not continue another call ends the output, and adds no
text), a call cut by `max_tokens` is neither content nor a call, and `response_format` beside
`tools` under `tool_choice: auto` admits a call or content in the schema.

The scripted model (every raw logprob in closed form) gives exact ids and entries; the embedded
SmolLM2-135M-Instruct, served with a Qwen2.5-style Hermes template written here, is a real model
that, forced to call, wants to write on after its call (it called again and again before)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pydantic
import pytest

from omlx_logprobs.api.core.tools import marker_tokens
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.scripted import script_ids
from omlx_logprobs.parsing.grammar import tool_calls_grammar
from omlx_logprobs.types import Constraint, ConstraintKind
from tests.engine.test_structured import allowed_sets, masked_log_softmax
from tests.helpers.engine import reference_logprobs
from tests.helpers.scripted import expected
from tests.helpers.scripted_tools import CASES, WEATHER, case_ids, write_tools_description
from tests.helpers.scripted_tools import TOOLS as SCRIPTED_TOOLS
from tests.helpers.server import thread_server
from tests.integration.test_forced_calls import entries, joined


class Served:
    def __init__(self, url: str, model: LoadedModel) -> None:
        self.url, self.model = url, model

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = load_model(str(write_tools_description(tmp_path_factory.mktemp("e") / "t.json")))
    with thread_server(model, tool_format="hermes") as (url, _):
        yield Served(url, model)


def ask(s: Served, case: str, stream: bool, **kw: Any) -> dict[str, Any]:
    """One choice of the scripted case, as the non-streamed body (a stream joined into it)."""
    extra = {"return_token_ids": True, "flat_logprobs": False, **kw.pop("extra_body", {})}
    body = dict(
        model="scripted-tools",
        messages=[{"role": "user", "content": f"Case: {case}"}],
        tools=SCRIPTED_TOOLS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
        **kw,
    )
    c = s.client()
    got = joined(c, body) if stream else c.chat.completions.create(**body).model_dump()
    got["choices"][0]["prompt_token_ids"] = got.get("prompt_token_ids") or got["choices"][0].get(
        "prompt_token_ids"
    )
    return got


def forced_grammar(model: LoadedModel) -> Constraint:
    tokens = marker_tokens(model.tokenizer)
    text = tool_calls_grammar("hermes", SCRIPTED_TOOLS, None, True, None, tokens=tokens)
    return Constraint(ConstraintKind.TOOL_CALLS, text, strict=False)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_a_forced_call_ends_where_the_model_leaves_it(
    scripted: Served, stream: bool, mode: str
) -> None:
    """`required`: the script is a call, a newline, then "Done." The call and the newline
    pass the grammar (a newline may close the calls); "Done" continues no call, so the output
    ends with it: its id and entry are there, its text is not. Every entry is a tool-call
    entry; raw logprobs are the closed form; processed ones are masked inside the call and
    the model's own distribution once the call is complete."""
    model = scripted.model
    ids, _ = case_ids(model, "leave")
    head = sum(len(script_ids([seg], model.tokenizer)) for _, seg in CASES["leave"].segments[:3])
    tail = script_ids([{"text": "\nDone."}], model.tokenizer)
    assert model.tokenizer.decode(tail[:1]) == "\n"
    want = ids[: head + 2]  # the call, "\n", and "Done", which leaves the grammar
    got = ask(scripted, "leave", stream, tool_choice="required", extra_body={"logprobs_mode": mode})
    ch = got["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert not ch["message"]["content"]
    [call] = ch["message"]["tool_calls"]
    assert call["function"]["name"] == WEATHER[0]
    assert json.loads(call["function"]["arguments"]) == WEATHER[1]
    assert ch["token_ids"] == want
    lp = ch["logprobs"]
    assert not lp["content"] and len(lp["tool_calls"]) == len(want)
    values = [e["logprob"] for e in entries(lp)]
    if mode == "raw_logprobs":
        for step, (v, t) in enumerate(zip(values, want)):
            assert abs(v - expected(step, t, len(model.vocab)).logprob) < 2e-5
        return
    sets = allowed_sets(model, forced_grammar(model), want)
    assert sets[-1].all() and sets[-2].all() and not sets[0].all()
    prompt = ch["prompt_token_ids"]
    ref = reference_logprobs(model, prompt + want)[len(prompt) - 1 : -1]
    for i, t in enumerate(want):
        assert abs(values[i] - masked_log_softmax(ref[i], sets[i])[t]) < 1e-4


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_cut_forced_call_is_neither_content_nor_a_call(scripted: Served, stream: bool) -> None:
    """`max_tokens` inside the forced call: `length`, no call, no content (the cut call's text
    is dropped), and the tokens' entries in the tool-call section, one per id."""
    ids, _ = case_ids(scripted.model, "forced")
    got = ask(scripted, "forced", stream, tool_choice="required", max_tokens=6)
    ch = got["choices"][0]
    assert ch["finish_reason"] == "length"
    assert not ch["message"]["content"] and not ch["message"]["tool_calls"]
    assert ch["token_ids"] == ids[:6]
    assert not ch["logprobs"]["content"] and len(ch["logprobs"]["tool_calls"]) == 6


class Answer(pydantic.BaseModel):
    answer: str


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_object"},
        {"type": "json_schema",
         "json_schema": {"name": "Answer", "schema": Answer.model_json_schema(), "strict": True}},
    ],
    ids=["json_object", "json_schema"],
)  # fmt: skip
def test_a_schema_beside_tools_admits_a_call_or_an_answer(
    scripted: Served, fmt: dict[str, Any]
) -> None:
    """`tool_choice` auto with `response_format`: the script that calls comes back as a call
    (`tool_calls`), the one that answers in the schema as content, which the client's `parse`
    reads into the pydantic model; each token's raw logprob is the closed form."""
    model = scripted.model
    got = ask(scripted, "forced", False, response_format=fmt)
    ch = got["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and not ch["message"]["content"]
    [call] = ch["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == WEATHER[1]
    ids, _ = case_ids(model, "schema")
    got = ask(scripted, "schema", True, response_format=fmt)
    ch = got["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["token_ids"] == ids
    assert json.loads(ch["message"]["content"]) == {"answer": "sunny"}
    for step, (e, t) in enumerate(zip(entries(ch["logprobs"]), ids)):
        assert abs(e["logprob"] - expected(step, t, len(model.vocab)).logprob) < 2e-5
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in SCRIPTED_TOOLS]
    parsed = scripted.client().chat.completions.parse(  # `parse` takes strict tools only
        model="scripted-tools",
        messages=[{"role": "user", "content": "Case: schema"}],
        tools=strict,
        response_format=Answer,
        temperature=0,
    )
    assert parsed.choices[0].message.parsed == Answer(answer="sunny")


# Qwen2.5's tool prompt (its own words), on ChatML.
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n"
    "You may call one or more functions to assist with the user query.\\n\\nYou are provided"
    " with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and"
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name":'
    ' <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def smol(embedded_dir: Path) -> Iterator[Served]:
    model = load_model(str(embedded_dir))
    model.tokenizer.chat_template = QWEN_TOOLS
    with thread_server(model, tool_format="hermes") as (url, _):
        yield Served(url, model)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_real_model_ends_its_forced_call(smol: Served, stream: bool) -> None:
    """SmolLM2, forced, writes a newline after its call and then wants text: `required` and a
    named function (`parallel_tool_calls` left at its default) each give one call, get_weather
    for Paris, with `tool_calls` / `stop`, well inside `max_tokens`; every token's entry is in
    the tool-call section, one per id."""
    c = smol.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in (("required", "tool_calls"), (named, "stop")):
        body = dict(
            model=smol.model.name,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice=choice,
            temperature=0,
            max_tokens=150,
            logprobs=True,
            extra_body={"return_token_ids": True, "flat_logprobs": False},
        )
        got = joined(c, body) if stream else c.chat.completions.create(**body).model_dump()
        ch = got["choices"][0]
        assert ch["finish_reason"] == finish
        assert not ch["message"]["content"]
        [call] = ch["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert len(ch["token_ids"]) < 60
        lp = ch["logprobs"]
        assert not lp["content"] and len(lp["tool_calls"]) == len(ch["token_ids"])
        assert all(np.isfinite(e["logprob"]) for e in lp["tool_calls"])
