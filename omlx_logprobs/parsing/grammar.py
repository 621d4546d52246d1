"""A request's `Constraint` as an llguidance grammar (docs/specs/structured.md): JSON Schema,
any JSON object, a regex, a list of choices or a Lark grammar (GBNF converted). Pure: no
tokenizer here; the engine builds one matcher per row from the text this returns, and the API
checks it first so that a bad schema is a 400, never a failed request."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, cast

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from omlx_logprobs.types import Constraint, ConstraintKind

__all__ = [
    "FORCED_FORMATS",
    "GrammarError",
    "check",
    "grammar_text",
    "calls_or_content",
    "hermes_tool_calls",
    "tool_calls_grammar",
]


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
    if c.kind is ConstraintKind.TOOL_CALLS:
        return c.source  # built by tool_calls_grammar / calls_or_content, in llguidance's form
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


# The tool-call formats a forced call can be written in (parsing/tools/ reads each back).
FORCED_FORMATS = ("hermes", "qwen3_coder", "llama3_json", "mistral", "harmony")
# The markers of those formats: where one is a single token of the model, the grammar names
# that token (llguidance's tokenizer gives added tokens such as `<tool_call>` no text bytes,
# so a quoted literal would not match the token the model writes).
MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|channel|>",
    "<|constrain|>",
    "<|message|>",
)


# More calls, each after a newline, and a newline after the last: a model that writes one after
# its call can still end its turn there (a tool-call grammar is open-ended once complete).
_MORE = ' ("\\n" call)* "\\n"?'


class _Lit:
    """Grammar literals: text as a quoted Lark string, a marker as its token where the model
    has one."""

    def __init__(self, tokens: Mapping[str, int] | None) -> None:
        self.tokens = tokens or {}

    def __call__(self, *parts: str) -> str:
        """Each part (a marker or plain text) as grammar, in order, space-separated."""
        return " ".join(
            f"<[{self.tokens[p]}]>" if p in self.tokens else json.dumps(p) for p in parts if p
        )


def tool_calls_grammar(
    fmt: str,
    tools: list[dict[str, Any]] | tuple[dict[str, Any], ...],
    name: str | None = None,
    parallel: bool = True,
    whitespace: str | None = None,
    mistral_args: bool = False,
    tokens: Mapping[str, int] | None = None,
) -> str:
    """A Lark grammar (a `ConstraintKind.GRAMMAR` source) of tool calls in the model's own
    format `fmt`: what `tool_choice` `required` (`name` None: any of `tools`) or a named
    function forces. One call, or with `parallel` one or more (and the format's separator after
    the last), each naming a tool (the named one) with arguments that follow its `parameters`
    schema. The model ends its turn after any complete call: a `ConstraintKind.TOOL_CALLS`
    constraint lets any token follow a complete grammar, and one that does not continue it
    ends the output. `tools` are OpenAI's
    `{"type": "function", "function": {...}}` entries; `whitespace` as in `Constraint` (inside
    the JSON); `mistral_args`: Mistral's v11 form (`[TOOL_CALLS]NAME[ARGS]{...}` per call) in
    place of v3's JSON list; `tokens`: the `MARKERS` that are one token of the model, with
    their ids. GrammarError for a format with no grammar or no matching tool."""
    if fmt == "hermes":
        return hermes_tool_calls(tools, name, parallel, whitespace, tokens)
    lit = _Lit(tokens)
    fns = _functions(tools, name)
    ws = _json_options(Constraint(ConstraintKind.JSON_SCHEMA, "{}", False, whitespace))
    if fmt == "llama3_json":
        body = _json_rule([_call_schema(f, "parameters") for f in fns], ws)
        more = ' ("; " call)* ";"?' if parallel else ""
        return f"start: call{more}\ncall: {body}\n"
    if fmt == "mistral" and not mistral_args:
        items: dict[str, Any] = {"anyOf": [_call_schema(f, "arguments") for f in fns]}
        listed = {"type": "array", "items": items, "minItems": 1}
        if not parallel:
            listed["maxItems"] = 1
        return f"start: {lit('[TOOL_CALLS]')} calls\ncalls: {_json_rule([listed], ws)}\n"
    if fmt == "mistral":
        rules = [
            f"f{i}: {lit('[TOOL_CALLS]', f['name'], '[ARGS]')} {_json_rule([_args(f)], ws)}"
            for i, f in enumerate(fns)
        ]
        plus = "+" if parallel else ""
        return f"start: call{plus}\ncall: {_alternatives(fns)}\n" + "\n".join(rules) + "\n"
    if fmt == "harmony":  # one call a turn: `<|call|>` (an end of turn) follows its arguments
        rules = [
            f"f{i}: {lit('<|channel|>', 'commentary to=functions.' + f['name'] + ' ')}"
            f" {lit('<|constrain|>', 'json', '<|message|>')} {_json_rule([_args(f)], ws)}"
            for i, f in enumerate(fns)
        ]
        return f"start: {_alternatives(fns)}\n" + "\n".join(rules) + "\n"
    if fmt == "qwen3_coder":
        return _qwen3_coder(fns, parallel, ws, lit)
    raise GrammarError(
        f"no grammar for tool-call format {fmt!r}; forced calls are written in "
        + ", ".join(FORCED_FORMATS)
    )


def calls_or_content(calls: str, content: Constraint) -> str:
    """llguidance's grammar of either tool calls (`calls`, a grammar of `tool_calls_grammar`) or
    content that matches `content` (a request's `response_format` or `structured_outputs`):
    what `tools` beside an output constraint allow under `tool_choice: auto`, so that an agent
    can call its tools and then answer in its schema. GrammarError for a bad `content`."""
    inner = check(content)
    if inner.lstrip().startswith("{"):  # JSON schema, regex: a top-level grammar of one
        sub = json.loads(inner)["grammars"][0]
    else:  # Lark text
        sub = {"lark_grammar": inner}
    head, rest = calls.split("\n", 1)
    if not head.startswith("start:"):
        raise GrammarError("a tool-call grammar opens with its start rule")
    main = f"start: calls | @content\ncalls:{head[len('start:') :]}\n{rest}"
    grammars = [{"name": "calls_or_content", "lark_grammar": main}, {**sub, "name": "content"}]
    return json.dumps({"grammars": grammars})


def _functions(tools: Any, name: str | None) -> list[dict[str, Any]]:
    fns = [t.get("function", t) for t in tools]
    fns = [f for f in fns if name is None or f.get("name") == name]
    if not fns:
        raise GrammarError(f"no tool named {name!r}" if name else "no tools")
    return fns


def _args(f: dict[str, Any]) -> dict[str, Any]:
    params = f.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _call_schema(f: dict[str, Any], args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, args_key: _args(f)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _json_rule(schemas: list[dict[str, Any]], ws: dict[str, Any]) -> str:
    """`%json` of one schema or any of several. Not strict: a parameters keyword llguidance
    cannot enforce is ignored, as OpenAI does for functions without `strict`."""
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return f"%json {json.dumps({**schema, 'x-guidance': ws})}"


def _alternatives(fns: list[dict[str, Any]]) -> str:
    return " | ".join(f"f{i}" for i in range(len(fns)))


def _qwen3_coder(fns: list[dict[str, Any]], parallel: bool, ws: dict[str, Any], lit: _Lit) -> str:
    """`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n
    </tool_call>`: the parameters in their schema's order, the required ones always; a value
    typed by its schema as the parser reads it back (JSON for numbers, booleans, null, objects
    and arrays; text for strings, an enum's strings, up to `maxLength` characters)."""
    more = _MORE if parallel else ""
    lines = [f"start: call{more}", f"call: {_alternatives(fns)}"]
    for i, f in enumerate(fns):
        schema = _args(f)
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        params = []
        for j, (key, prop) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            params.append(rule if key in required else f"{rule}?")
            value = _xml_value(f"v{i}_{j}", prop, ws, lines)
            tag = json.dumps(f"<parameter={key}>\n")
            lines.append(f"{rule}: {tag} {value}")
        head = lit("<tool_call>", f"\n<function={f['name']}>\n")
        tail = lit("</function>\n", "</tool_call>")
        lines.append(f"f{i}: {head} {' '.join(params)} {tail}")
    return "\n".join(lines) + "\n"


def _xml_value(rule: str, prop: Any, ws: dict[str, Any], lines: list[str]) -> str:
    """The grammar of one parameter's value and its closing tag; defines `rule` in lines."""
    prop = prop if isinstance(prop, dict) else {}
    types = prop.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    end = '"\\n</parameter>\\n"'
    if types and "string" not in types:
        lines.append(f"{rule}: {_json_rule([prop], ws)}")
        return f"{rule} {end}"
    choices = prop.get("enum") or ([prop["const"]] if "const" in prop else None)
    if choices and all(isinstance(c, str) for c in choices):
        lines.append(f"{rule}: " + " | ".join(json.dumps(c) for c in choices))
        return f"{rule} {end}"
    # Text up to the closing tag: lazy, so that the first `\n</parameter>` ends it.
    low, high = int(prop.get("minLength") or 0), prop.get("maxLength")
    count = f"{{{low},{int(high)}}}" if isinstance(high, int) else (f"{{{low},}}" if low else "*")
    lines.append(f'{rule}[suffix="\\n</parameter>\\n"]: /(?s:.){count}/')
    return rule


def hermes_tool_calls(
    tools: list[dict[str, Any]] | tuple[dict[str, Any], ...],
    name: str | None = None,
    parallel: bool = True,
    whitespace: str | None = None,
    tokens: Mapping[str, int] | None = None,
) -> str:
    """Hermes/Qwen calls: one, or with `parallel` several separated by a newline, each
    `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (as Qwen's templates write
    them); the arguments of `tool_calls_grammar`."""
    fns = _functions(tools, name)
    ws = _json_options(Constraint(ConstraintKind.JSON_SCHEMA, "{}", False, whitespace))
    body = _json_rule([_call_schema(f, "arguments") for f in fns], ws)
    lit = _Lit(tokens)
    more = _MORE if parallel else ""
    opening, closing = lit("<tool_call>", "\n"), lit("\n", "</tool_call>")
    return f"start: call{more}\ncall: {opening} body {closing}\nbody: {body}\n"
