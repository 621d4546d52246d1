"""Constrained output through the real server and the real `openai` client: `response_format`
with a pydantic model (`client.chat.completions.parse`), JSON mode streamed, vLLM's
`structured_outputs` on completions with n choices, processed logprobs against an independent
float32 forward masked by a fresh matcher, and the 400s of bad constraints."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import openai
import pydantic
import pytest

from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import Constraint, ConstraintKind
from tests.engine.test_structured import allowed_sets, masked_log_softmax
from tests.helpers.engine import reference_logprobs
from tests.helpers.server import MODEL_NAME


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=99)
    kind: Literal["capital", "other"]


def messages(q: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": q}]


def test_parse_with_a_pydantic_model(client: openai.OpenAI, embedded: LoadedModel) -> None:
    """The openai client's own parsing; the tokens re-checked by a fresh matcher of the schema
    the client sent; processed logprobs are the masked distribution (an RL ratio of 1)."""
    r = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=messages("Describe Paris as JSON."),
        response_format=City,
        temperature=0.7,
        seed=3,
        max_tokens=200,
        logprobs=True,
        extra_body={"return_token_ids": True, "logprobs_mode": "processed_logprobs"},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    city = choice.message.parsed
    assert isinstance(city, City) and city == City.model_validate_json(choice.message.content)
    schema = openai.lib._pydantic.to_strict_json_schema(City)
    c = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    prompt, out = r.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    sets = allowed_sets(embedded, c, out)
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    assert choice.logprobs is not None
    lps = [e.logprob for e in choice.logprobs.content]
    assert len(lps) == len(out)
    for i, t in enumerate(out):  # temperature 0.7: the masked, tempered log-softmax
        want = masked_log_softmax(ref[i] / 0.7, sets[i])
        assert abs(lps[i] - want[t]) < 1e-4


def test_json_mode_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages("Give a JSON object with a name and an age."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert isinstance(json.loads(text), dict)


def test_structured_outputs_on_completions_with_n(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="The date today is",
        max_tokens=20,
        n=3,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"regex": r" 20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        assert re.fullmatch(r" 20[0-9]{2}-[01][0-9]-[0-3][0-9]", ch.text), ch.text
    picked = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages("Is the sky blue?"),
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["Yes, it is", "No"]}},
    )
    assert picked.choices[0].message.content in ("Yes, it is", "No")


def so(**fields: Any) -> dict[str, Any]:
    return {"extra_body": {"structured_outputs": fields}}


@pytest.mark.parametrize(
    "kw, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (so(regex="[a-"), "structured_outputs"),
        (so(grammar="start: nothere"), "structured_outputs"),
        (so(regex="a", choice=["b"]), "structured_outputs"),
        (so(disable_any_whitespace=True), "structured_outputs"),  # options alone
        (so(jsn={}), "structured_outputs.jsn"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "guided_regex",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 3}},
            "min_tokens",
        ),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages("hi"), max_tokens=5, **kw
        )
    assert e.value.body["param"] == param, e.value.body
