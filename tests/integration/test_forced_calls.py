"""`tool_choice` `required` and a named function: the calls' grammar in the model's own format
(parsing/grammar.py `tool_calls_grammar`) through the real server and the `openai` client.

On the tiny seeded random model, whose free text is never a call, every format (Hermes,
Qwen3-Coder, Llama 3 JSON, Mistral's two forms, harmony): every response is calls to the allowed
tools (the named one) whose arguments validate against the tools' schemas (the pydantic models
that wrote them), streamed and not, through the client's `parse` and its stream helper;
`finish_reason` `tool_calls` for `required`, `stop` for a named function (OpenAI's and vLLM's
answers); every sampled token re-checked by a fresh matcher of the same grammar, and processed
logprobs equal to a float32 log-softmax of an independent forward pass masked by that matcher's
allowed set (1e-4). On the scripted model, a script that is exactly a call passes the grammar
untouched: its ids, its raw logprobs in closed form and its processed ones masked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

import httpx
import numpy as np
import openai
import pydantic
import pytest

from omlx_logprobs.api.core.tools import marker_tokens
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.parsing.grammar import tool_calls_grammar
from omlx_logprobs.types import HARMONY_REASONING, THINK_TAGS, Constraint, ConstraintKind
from tests.engine.test_structured import allowed_sets, masked_log_softmax
from tests.helpers.engine import reference_logprobs
from tests.helpers.scripted import expected
from tests.helpers.scripted_tools import TOOLS as SCRIPTED_TOOLS
from tests.helpers.scripted_tools import case_ids, write_tools_description
from tests.helpers.server import assert_openai_error, thread_server


class GetWeather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=8)
    unit: Literal["c", "f"]
    days: int = pydantic.Field(default=1, ge=1, le=9)


class Add(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    a: int = pydantic.Field(ge=0, le=99)
    b: int = pydantic.Field(ge=0, le=99)


ARGS = {"get_weather": GetWeather, "add": Add}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": m.model_json_schema()}}
    for n, m in ARGS.items()
]
# Compact JSON: a random model would otherwise fill max_tokens with JSON whitespace.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
NAMED = {"type": "function", "function": {"name": "add"}}
# Tools in a system turn; the Jinja comment carries what the format's detection reads.
TEMPLATE = (
    "{#- MARK #}{%- if tools %}{{ '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# (server format, a mark in the template): "mistral11" is Mistral's [ARGS] form.
FORMATS = {
    "hermes": ("hermes", ""),
    "qwen3_coder": ("qwen3_coder", ""),
    "llama3_json": ("llama3_json", ""),
    "mistral": ("mistral", ""),
    "mistral11": ("mistral", "[ARGS]"),
    "harmony": ("harmony", ""),
}


class Served(NamedTuple):
    fmt: str  # a FORMATS key
    url: str
    model: LoadedModel

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=300)


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[Served]:
    """The tiny model (its own copy: the template is changed) served in one format."""
    fmt, mark = FORMATS[request.param]
    model = load_model(str(tiny_dir))
    model.tokenizer.chat_template = TEMPLATE.replace("MARK", mark)
    harmony = fmt == "harmony"
    tags = HARMONY_REASONING if harmony else THINK_TAGS
    with thread_server(model, tool_format=fmt, reasoning=harmony, reasoning_tags=tags) as (u, _):
        yield Served(request.param, u, model)


def grammar(s: Served, name: str | None, parallel: bool) -> Constraint:
    """The constraint the server builds for these tools, rebuilt here."""
    fmt, mark = FORMATS[s.fmt]
    tokens = marker_tokens(s.model.tokenizer)
    # a named function: one call, whatever parallel_tool_calls says
    text = tool_calls_grammar(fmt, TOOLS, name, parallel and name is None, "", bool(mark), tokens)
    return Constraint(ConstraintKind.TOOL_CALLS, text, strict=False)


def valid_calls(calls: list[Any], named: str | None) -> None:
    assert calls, "no tool call"
    for c in calls:
        fn = c["function"] if isinstance(c, dict) else c.function.model_dump()
        assert fn["name"] in ARGS and (named is None or fn["name"] == named)
        ARGS[fn["name"]].model_validate_json(fn["arguments"])


def request(s: Served, **kw: Any) -> dict[str, Any]:
    extra = {**COMPACT, **kw.pop("extra_body", {})}
    base = dict(
        model=s.model.name,
        messages=[{"role": "user", "content": "Use a tool."}],
        tools=TOOLS,
        max_tokens=160,
        temperature=1.0,
    )
    return {**base, **kw, "extra_body": extra}


def entries(lp: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for k in ("reasoning_content", "content", "tool_calls") for e in lp.get(k) or []]


def check_tokens(s: Served, body: dict[str, Any], ch: dict[str, Any], named: str | None) -> None:
    """Each token against a fresh matcher of the grammar; processed logprobs (and the top
    list) against the masked float32 log-softmax of a full forward pass (temperature 1)."""
    prompt, out = body["prompt_token_ids"], ch["token_ids"]
    sets = allowed_sets(s.model, grammar(s, named, parallel=False), out)
    ref = reference_logprobs(s.model, prompt + out)[len(prompt) - 1 : -1]
    got = entries(ch["logprobs"])
    assert [int(e["token"].removeprefix("token_id:")) for e in got] == out
    for i, t in enumerate(out):
        want = masked_log_softmax(ref[i], sets[i])
        assert abs(got[i]["logprob"] - want[t]) < 1e-4
        for alt in got[i]["top_logprobs"]:
            tid = int(alt["token"].removeprefix("token_id:"))
            w = want[tid] if np.isfinite(want[tid]) else -9999.0
            assert abs(alt["logprob"] - w) < 1e-4


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_every_response_is_a_valid_call(served: Served, stream: bool) -> None:
    """`required` and a named function, n = 3 seeded choices each, one call a choice
    (`parallel_tool_calls` false): calls to the allowed tools with valid arguments and no
    content; every token allowed by a fresh matcher; processed logprobs the masked
    distribution. Streamed: the same calls, the same tokens and entries."""
    c = served.client()
    for choice, named, finish in (("required", None, "tool_calls"), (NAMED, "add", "stop")):
        body = request(
            served,
            tool_choice=choice,
            parallel_tool_calls=False,
            n=3,
            seed=7,
            logprobs=True,
            top_logprobs=3,
            extra_body={
                "return_token_ids": True,
                "flat_logprobs": False,
                "return_tokens_as_token_ids": True,
                "logprobs_mode": "processed_logprobs",
            },
        )
        got = joined(c, body) if stream else c.chat.completions.create(**body).model_dump()
        for ch in got["choices"]:
            assert ch["finish_reason"] == finish, ch
            assert not ch["message"]["content"], ch["message"]
            valid_calls(ch["message"]["tool_calls"], named)
            assert len(ch["message"]["tool_calls"]) == 1
            check_tokens(served, got, ch, named)


def joined(c: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed response joined into the non-streamed shape (choices in index order)."""
    chunks = [x.model_dump() for x in c.chat.completions.create(stream=True, **body)]
    prompt = chunks[0]["choices"][0]["prompt_token_ids"]  # with the first chunk (vLLM)
    n = body.get("n", 1)
    msgs: list[dict[str, Any]] = [
        {"message": {"content": "", "tool_calls": []}, "token_ids": [], "finish_reason": None,
         "logprobs": {"reasoning_content": [], "content": [], "tool_calls": []}}
        for _ in range(n)
    ]  # fmt: skip
    for x in chunks:
        for ch in x["choices"]:
            m = msgs[ch["index"]]
            m["finish_reason"] = ch["finish_reason"] or m["finish_reason"]
            m["message"]["content"] += ch["delta"].get("content") or ""
            for call in ch["delta"].get("tool_calls") or []:
                assert call["index"] == len(m["message"]["tool_calls"])
                m["message"]["tool_calls"].append(call)
            m["token_ids"] += ch.get("token_ids") or []
            for k, v in (ch["logprobs"] or {}).items():
                if k in m["logprobs"]:
                    m["logprobs"][k] += v or []
    return {"prompt_token_ids": prompt, "choices": msgs}


def test_parallel_calls_and_the_clients_parsing(served: Served) -> None:
    """`required` with parallel calls allowed: one or more calls, each valid (a call that
    `max_tokens` cut is dropped, and then `finish_reason` is `length`). The client's own
    parsing: `parse` with pydantic tools and the stream helper's accumulated calls."""
    c = served.client()
    r = c.chat.completions.create(
        **request(served, tool_choice="required", n=2, seed=3, max_tokens=300)
    )
    for ch in r.model_dump()["choices"]:
        valid_calls(ch["message"]["tool_calls"], None)
        if ch["finish_reason"] != "length":
            assert ch["finish_reason"] == "tool_calls" and not ch["message"]["content"]
    tools = [openai.pydantic_function_tool(m, name=n) for n, m in ARGS.items()]
    for choice, named in (("required", None), (NAMED, "add")):
        body = {
            **request(served, tool_choice=choice, parallel_tool_calls=False, seed=1),
            "tools": tools,
        }
        parsed = c.chat.completions.parse(**body).choices[0].message.tool_calls
        assert parsed and all(
            isinstance(t.function.parsed_arguments, ARGS[t.function.name]) for t in parsed
        )
        assert named is None or parsed[0].function.name == named
        with c.chat.completions.stream(**body) as s:
            final = s.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert calls and all(
            isinstance(t.function.parsed_arguments, ARGS[t.function.name]) for t in calls
        )
        assert final.choices[0].finish_reason == ("stop" if named else "tool_calls")


def test_forced_calls_refused(served: Served) -> None:
    """A named function not in tools, a forced call beside min_tokens, `required` without
    tools: 400s naming the field."""
    url = served.url + "/v1/chat/completions"
    base = {
        "model": served.model.name,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
    }
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "min_tokens": 2}, "min_tokens"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ]  # fmt: skip
    for extra, param in cases:
        r = httpx.post(url, json={**base, **extra})
        assert_openai_error(r, 400, param)


def test_a_template_without_tools_refuses_them(tiny_dir: Path) -> None:
    """A server with a tool-call format, but a chat template that never writes `tools` (the
    model would not see them): tools that may be called are a 400 naming `tools`; with
    `tool_choice` none the request runs (the tools are only shown)."""
    model = load_model(str(tiny_dir))
    model.tokenizer.chat_template = TEMPLATE.replace("{%- if tools %}", "{%- if false %}")
    with thread_server(model, tool_format="hermes") as (url, _):
        body = {"model": model.name, "messages": [{"role": "user", "content": "hi"}]}
        for choice in ("auto", "required", NAMED):
            r = httpx.post(url + "/v1/chat/completions",
                           json={**body, "tools": TOOLS, "tool_choice": choice})  # fmt: skip
            err = assert_openai_error(r, 400, "tools")
            assert "does not show tools to the model" in err["message"]
        r = httpx.post(
            url + "/v1/chat/completions",
            json={**body, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def scripted_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = load_model(str(write_tools_description(tmp_path_factory.mktemp("f") / "t.json")))
    with thread_server(model, tool_format="hermes") as (url, _):
        yield Served("hermes", url, model)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_a_scripted_call_passes_the_grammar(scripted_tools: Served, mode: str) -> None:
    """The scripted model's "forced" script is a Hermes call that the grammar allows (its
    markers single tokens here, named by id in the grammar): the same ids come back, raw
    logprobs in closed form, processed ones masked by the grammar's allowed sets."""
    s = scripted_tools
    model = s.model
    ids, _ = case_ids(model, "forced")
    c = s.client()
    for choice, finish in (("required", "tool_calls"), (
        {"type": "function", "function": {"name": "get_weather"}}, "stop")):  # fmt: skip
        r = c.chat.completions.create(
            model="scripted-tools",
            messages=[{"role": "user", "content": "Case: forced"}],
            tools=SCRIPTED_TOOLS,
            tool_choice=choice,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"return_token_ids": True, "flat_logprobs": False, "logprobs_mode": mode},
        )
        body = r.model_dump()
        ch = body["choices"][0]
        # a named function's one call ends the output as soon as it is complete (no EOS)
        want = ids if choice == "required" else ids[:-1]
        assert ch["token_ids"] == want and ch["finish_reason"] == finish
        [call] = ch["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        got = [e["logprob"] for e in entries(ch["logprobs"])]
        assert len(got) == len(want)
        if mode == "raw_logprobs":
            for step, (lp, tid) in enumerate(zip(got, want)):
                assert abs(lp - expected(step, tid, len(model.vocab)).logprob) < 2e-5
            continue
        named = None if choice == "required" else "get_weather"
        tokens = marker_tokens(model.tokenizer)
        assert "<tool_call>" in tokens  # one token here: the grammar names it by id
        one = named is not None  # a named function: one call
        text = tool_calls_grammar("hermes", SCRIPTED_TOOLS, named, not one, None, tokens=tokens)
        cons = Constraint(ConstraintKind.TOOL_CALLS, text, strict=False)
        sets = allowed_sets(model, cons, want)
        prompt = body["prompt_token_ids"]
        ref = reference_logprobs(model, prompt + want)[len(prompt) - 1 : -1]
        for i, t in enumerate(want):
            assert abs(got[i] - masked_log_softmax(ref[i], sets[i])[t]) < 1e-4
