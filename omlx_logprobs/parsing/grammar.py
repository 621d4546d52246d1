"""A request's `Constraint` as an llguidance grammar (docs/specs/structured.md): JSON Schema,
any JSON object, a regex, a list of choices or a Lark grammar (GBNF converted). Pure: no
tokenizer here; the engine builds one matcher per row from the text this returns, and the API
checks it first so that a bad schema is a 400, never a failed request."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, cast

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from omlx_logprobs.types import Constraint, ConstraintKind

__all__ = ["GrammarError", "grammar_text", "check", "hermes_tool_calls"]


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message says why (llguidance's words)."""


def _json_options(c: Constraint) -> dict[str, Any]:
    opts: dict[str, Any] = {"lenient": not c.strict}
    if c.whitespace == "":
        opts["whitespace_flexible"] = False
    elif c.whitespace is not None:
        opts["whitespace_pattern"] = c.whitespace
    return opts


@lru_cache(maxsize=256)
def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for the constraint (not yet checked: see `check`). Cached: RL and
    agent loops send the same schema with every request."""
    M = llguidance.LLMatcher
    if c.kind is ConstraintKind.JSON_SCHEMA or c.kind is ConstraintKind.JSON_OBJECT:
        schema = (
            json.loads(c.source) if c.kind is ConstraintKind.JSON_SCHEMA else {"type": "object"}
        )
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema is an object (or a boolean)")
        try:  # the request's own x-guidance (if any) wins over the options it implies
            options: Any = _json_options(
                c
            )  # a JsonCompileOptions dict (the stubs name a TypedDict)
            return M.grammar_from_json_schema(cast(Any, schema), defaults=options)
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from exc
    if c.kind is ConstraintKind.REGEX:
        return M.grammar_from_regex(c.source)
    if c.kind is ConstraintKind.CHOICE:
        choices = json.loads(c.source)
        # JSON string literals are Lark's string syntax too: quotes and escapes survive.
        return M.grammar_from_lark(
            "start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)
        )
    try:
        return M.grammar_from_lark(any_to_lark(c.source))
    except Exception as exc:  # the GBNF converter's own parse errors
        raise GrammarError(f"cannot read the grammar: {exc}") from exc


@lru_cache(maxsize=256)
def check(c: Constraint) -> str:
    """The grammar text, or GrammarError with llguidance's message (a bad regex, an unknown
    rule, a schema keyword it cannot enforce under `strict`)."""
    text = grammar_text(c)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise GrammarError(error.strip())
    return text


def hermes_tool_calls(
    tools: list[dict[str, Any]],
    name: str | None = None,
    parallel: bool = True,
    whitespace: str | None = None,
) -> str:
    """A Lark grammar (a `ConstraintKind.GRAMMAR` source) of Hermes/Qwen tool calls, what
    `tool_choice` `required` (`name` None: any of `tools`) or a named function forces: one call,
    or with `parallel` several separated by a newline, each
    `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` whose arguments follow the
    function's `parameters` schema. `tools` are OpenAI's `{"type": "function", "function":
    {...}}` entries; `whitespace` as in `Constraint` (inside the JSON)."""
    calls = []
    for t in tools:
        f = t.get("function", t)
        if name is not None and f.get("name") != name:
            continue
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not calls:
        raise GrammarError(f"no tool named {name!r}" if name else "no tools")
    # Not strict: a parameters keyword llguidance cannot enforce is ignored, as OpenAI does
    # for functions without `strict`.
    c = Constraint(ConstraintKind.JSON_SCHEMA, "{}", strict=False, whitespace=whitespace)
    schema = {"anyOf": calls, "x-guidance": _json_options(c)}
    more = ' ("\\n" call)*' if parallel else ""
    return (
        f"start: call{more}\n"
        'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
        f"body: %json {json.dumps(schema)}\n"
    )
