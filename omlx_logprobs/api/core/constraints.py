"""A request's output constraint: `response_format`, vLLM's `structured_outputs` or its older
`guided_*` fields (one of them), read into one `Constraint` and compiled once, so that a bad
schema, regex or grammar is a 400 naming its field (api/core/validation.py holds the other
checks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.parsing.grammar import GrammarError, check
from omlx_logprobs.types import Constraint, ConstraintKind


def given(v: Any) -> bool:
    """A field's value asks for something (None, False, [] and {} ask for nothing)."""
    return v is not None and v is not False and v != [] and v != {}


def request_constraint(req: Any) -> Constraint | None:
    """The output grammar a request asks for (`response_format`, vLLM's
    `structured_outputs` or its older `guided_*` fields: one of them), compiled once here
    so that a bad schema, regex or grammar is a 400 naming its field."""
    found = [c for c in _constraints(req) if c is not None]
    if len(found) > 1:
        names = " and ".join(param for param, _ in found)
        raise APIError(f"{names}: at most one output constraint per request", param=found[1][0])
    if not found:
        so = getattr(req, "structured_outputs", None) or {}
        if so:  # options alone: a 400 asking for a kind of constraint (or naming a key),
            # unless they shape the JSON of a forced tool call (api/core/tools.py)
            _structured_outputs(so, None, options_only=_forces_call(req))
        return None
    param, c = found[0]
    param = param.split(".")[0]
    if getattr(req, "min_tokens", 0):
        raise APIError(
            f"min_tokens cannot be combined with {param}: the grammar decides where the"
            " output may end",
            param="min_tokens",
        )
    try:
        check(c)
    except GrammarError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
    return c


def _forces_call(req: Any) -> bool:
    choice = getattr(req, "tool_choice", None)
    return bool(getattr(req, "tools", None)) and choice not in (None, "none", "auto")


def whitespace_option(req: Any) -> str | None:
    """The JSON whitespace `structured_outputs` asks for (its two options), None for any."""
    return _whitespace(getattr(req, "structured_outputs", None) or {})


def constraint_field(req: Any) -> str | None:
    """The request field that set its constraint (None: none did)."""
    found = [c for c in _constraints(req) if c is not None]
    return found[0][0].split(".")[0] if found else None


# vLLM's `structured_outputs` keys: one kind of constraint, and options of the JSON ones.
_SO_KINDS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "json_object": ConstraintKind.JSON_OBJECT,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
}
_SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback")
_SO_REFUSED = {
    "structural_tag": "structural tags",
    "disable_additional_properties": "disable_additional_properties",
}


def _constraints(req: Any) -> Iterator[tuple[str, Constraint] | None]:
    """Each constraint the request sets, with the field that set it."""
    so = getattr(req, "structured_outputs", None) or {}
    whitespace = _whitespace(so)
    rf = getattr(req, "response_format", None)
    if rf is not None:
        yield _response_format(rf, whitespace)
    if so:  # without a kind of constraint, its options shape response_format's JSON
        yield _structured_outputs(so, whitespace) if set(so) & set(_SO_KINDS) else None
    guided = [
        ("guided_json", ConstraintKind.JSON_SCHEMA),
        ("guided_regex", ConstraintKind.REGEX),
        ("guided_choice", ConstraintKind.CHOICE),
        ("guided_grammar", ConstraintKind.GRAMMAR),
    ]
    for name, kind in guided:
        value = getattr(req, name, None)
        if value is not None:
            yield name, _constraint(name, kind, value, True, whitespace)


def _whitespace(so: dict[str, Any]) -> str | None:
    if so.get("disable_any_whitespace"):
        return ""
    pattern = so.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise APIError(
            "structured_outputs.whitespace_pattern must be a string", "structured_outputs"
        )
    return pattern


def _response_format(rf: dict[str, Any], whitespace: str | None) -> tuple[str, Constraint] | None:
    param = "response_format"
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return param, Constraint(ConstraintKind.JSON_OBJECT, "{}", True, whitespace)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object", param=param)
        schema = spec.get("schema", {})
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError("response_format.json_schema.strict must be a boolean", param=param)
        # OpenAI's default is not strict: keywords that cannot be enforced are then ignored.
        return param, _constraint(
            param, ConstraintKind.JSON_SCHEMA, schema, bool(strict), whitespace
        )
    if kind == "structural_tag":
        raise APIError(
            "response_format: structural_tag is not supported by this server.",
            param=param,
            code="unsupported_parameter",
        )
    raise APIError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param=param,
    )


def _structured_outputs(
    so: dict[str, Any], whitespace: str | None, options_only: bool = False
) -> tuple[str, Constraint]:
    """`options_only`: only its keys are checked (a request whose tool call is forced may send
    the whitespace options alone)."""
    param = "structured_outputs"
    for key in so:
        if key in _SO_REFUSED and given(so[key]):
            raise APIError(
                f"structured_outputs.{key}: {_SO_REFUSED[key]} is not supported by this server.",
                param=param,
                code="unsupported_parameter",
            )
        if key not in _SO_KINDS and key not in _SO_OPTIONS and key not in _SO_REFUSED:
            raise APIError(
                f"Unrecognized request argument supplied: structured_outputs.{key}",
                param=f"structured_outputs.{key}",
                code="unknown_parameter",
            )
    kinds = [k for k in _SO_KINDS if k in so and so[k] is not None and so[k] is not False]
    if options_only and not kinds:
        return param, Constraint(ConstraintKind.JSON_OBJECT, "{}")  # unused: keys checked
    if len(kinds) != 1:
        raise APIError(
            "structured_outputs needs exactly one of json, json_object, regex, choice, grammar"
            + (f" (got {', '.join(kinds)})" if kinds else ""),
            param=param,
        )
    key = kinds[0]
    if key == "json_object":
        return param, Constraint(ConstraintKind.JSON_OBJECT, "{}", True, whitespace)
    return param, _constraint(f"{param}.{key}", _SO_KINDS[key], so[key], True, whitespace)


def _constraint(
    param: str, kind: ConstraintKind, value: Any, strict: bool, whitespace: str | None
) -> Constraint:
    """A field's value as a Constraint, its type checked (its content is `check`ed later);
    errors name the request's field (`param` may be a path in it)."""
    field = param.split(".")[0]
    if kind is ConstraintKind.JSON_SCHEMA:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise APIError(f"{param}: not valid JSON ({exc})", param=field) from None
        if not isinstance(value, (dict, bool)):
            raise APIError(f"{param}: a JSON schema must be an object", param=field)
        return Constraint(kind, json.dumps(value), strict, whitespace)
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise APIError(f"{param}: a non-empty list of strings is needed", param=field)
        if any(not v for v in value):
            raise APIError(f"{param}: a choice must not be empty", param=field)
        return Constraint(kind, json.dumps(value), strict, whitespace)
    if not isinstance(value, str) or not value:
        raise APIError(f"{param}: a non-empty string is needed", param=field)
    return Constraint(kind, value, strict, whitespace)
