"""Request fields to a Constraint without a model: which field sets what, the JSON options, and
the grammar text llguidance gets (checked without a tokenizer)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from omlx_logprobs.api.core.bounds import ModelBounds
from omlx_logprobs.api.core.constraints import request_constraint
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.protocol import ChatCompletionRequest, CompletionRequest
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import Limits
from omlx_logprobs.parsing.grammar import GrammarError, check
from omlx_logprobs.types import Constraint, ConstraintKind

CHECKS = RequestLimits(Limits(), ModelBounds(100, 64, 20, 8, frozenset()))
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
S = json.dumps(SCHEMA)
K, C = ConstraintKind, Constraint
RF, SO = "response_format", "structured_outputs"


def chat(**kw: Any) -> ChatCompletionRequest:
    msgs = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, **kw})


def rf_schema(strict: bool | None = None, schema: Any = SCHEMA) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "x", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize(
    "body, want",
    [
        ({}, None),
        ({RF: {"type": "text"}}, None),
        ({RF: {"type": "json_object"}}, C(K.JSON_OBJECT, "{}")),
        ({RF: rf_schema()}, C(K.JSON_SCHEMA, S, strict=False)),  # OpenAI's default
        ({RF: rf_schema(True)}, C(K.JSON_SCHEMA, S)),
        ({SO: {"json": S}}, C(K.JSON_SCHEMA, S)),
        ({"guided_json": SCHEMA}, C(K.JSON_SCHEMA, S)),
        ({SO: {"regex": "a+", "disable_fallback": True}}, C(K.REGEX, "a+")),
        ({"guided_choice": ["x", "y"]}, C(K.CHOICE, '["x", "y"]')),
        ({SO: {"grammar": 'root ::= "a"'}}, C(K.GRAMMAR, 'root ::= "a"')),
        (
            {RF: {"type": "json_object"}, SO: {"disable_any_whitespace": True}},
            C(K.JSON_OBJECT, "{}", whitespace=""),
        ),
        (
            {SO: {"json_object": True, "whitespace_pattern": " ?"}},
            C(K.JSON_OBJECT, "{}", whitespace=" ?"),
        ),
    ],
)
def test_fields_to_constraint(body: dict[str, Any], want: Constraint | None) -> None:
    req = chat(**body)
    CHECKS.check_chat(req)
    assert request_constraint(req) == want
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    assert request_constraint(comp) == want  # the same on completions


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({RF: {"type": "json_schema"}}, RF, "must be an object"),
        ({RF: rf_schema(schema=[1])}, RF, "must be an object"),
        ({RF: rf_schema(True, {"type": "string", "format": "nope"})}, RF, "nope"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "must not be empty"),
        ({"guided_regex": "("}, "guided_regex", "regex"),
        ({SO: {"choice": "ab"}}, SO, "list of strings"),
        ({SO: {"json": {}, "regex": "a"}}, SO, "exactly one"),
        ({SO: {"structural_tag": "x"}}, SO, "not supported"),
        ({SO: {"regex": "a", "whitespace_pattern": 3}}, SO, "string"),
        ({RF: {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
        ({"guided_regex": "a", "min_tokens": 1}, "min_tokens", "min_tokens"),
    ],
)
def test_bad_constraints(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as e:
        CHECKS.check_chat(chat(**body))
    assert e.value.param == param and words in e.value.message, e.value.message


def test_lenient_schema_ignores_what_strict_refuses() -> None:
    schema = json.dumps({"type": "string", "format": "nope"})
    with pytest.raises(GrammarError):
        check(Constraint(ConstraintKind.JSON_SCHEMA, schema, strict=True))
    check(Constraint(ConstraintKind.JSON_SCHEMA, schema, strict=False))


def test_choice_literals_survive_quotes_and_escapes() -> None:
    """Each choice is a Lark string literal: the grammar accepts exactly the strings."""
    choices = ['say "hi"', "back\\slash", "new\nline", "snow ☃"]
    text = check(Constraint(ConstraintKind.CHOICE, json.dumps(choices)))
    tok = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_ByteTokenizer())  # type: ignore[arg-type]
    )
    for c in choices:
        m = llguidance.LLMatcher(tok, text)
        assert m.consume_tokens(list(c.encode())) and m.is_accepting(), c
    m = llguidance.LLMatcher(tok, text)
    assert not m.consume_tokens(list(b"say hi"))


class _ByteTokenizer:
    """256 one-byte tokens and an EOS: enough for llguidance to run a grammar over bytes."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)
