"""The tool-call formats, each a small `ToolCallParser`: where a call starts and ends, and how
its text becomes `ToolCall`s.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call (Hermes,
  Qwen 2.5, Qwen 3). Also reads a Qwen3-Coder body, as Qwen templates differ by release.
- qwen3_coder: `<tool_call><function=NAME><parameter=P>value</parameter>...</function>
  </tool_call>`; values are typed by the request's parameter schemas. Also reads a JSON body.
- llama3_json: the output opens with `{"name": ..., "parameters": {...}}` (or `<|python_tag|>`
  and that); several calls are separated by `;`.
- mistral: `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` (v3 tokenizers), or
  `[TOOL_CALLS]NAME[ARGS]{...}` per call (v11 and later; `[CALL_ID]id` may precede `[ARGS]`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from omlx_logprobs.parsing.tools.jsonspan import JsonSpan
from omlx_logprobs.parsing.tools.parser import ToolCallParser
from omlx_logprobs.types import ToolCall

_WS = " \t\r\n"


def _clean(text: str) -> str:
    """Invalid bytes arrive as surrogate escapes; in a call they become U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": str, "arguments": object or JSON text} as a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # arguments already as JSON text: kept if it is an object
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(_clean(text))
    except ValueError:
        return None


class _Tagged(ToolCallParser):
    """`<tool_call>` BODY `</tool_call>`: the body read as JSON or as Qwen3-Coder XML."""

    starts = ("<tool_call>",)
    close = "</tool_call>"

    def call_end(self, buf: str) -> int | None:
        at = buf.find(self.close, max(self._scanned, len(self.starts[0])))
        if at < 0:
            self._scanned = max(len(buf) - len(self.close) + 1, 0)
            return None
        return at + len(self.close)

    def decode(self, raw: str, closed: bool) -> list[ToolCall] | None:
        body = raw[len(self.starts[0]) :]
        body = body[: -len(self.close)] if closed else body
        call = self.body(body.strip(_WS))
        return [call] if call else None

    def body(self, body: str) -> ToolCall | None:
        if body.startswith("<function="):
            return _xml_call(body, self.tools)
        return _call(_json(body))


class Hermes(_Tagged):
    pass


class Qwen3Coder(_Tagged):
    pass


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _xml_call(body: str, tools: tuple[dict[str, Any], ...]) -> ToolCall | None:
    m = _FUNCTION.fullmatch(_clean(body))
    if m is None:
        return None
    name = m.group(1).strip()
    inner = m.group(2)
    params = list(_PARAMETER.finditer(inner))
    if _PARAMETER.sub("", inner).strip(_WS):  # text outside any parameter
        return None
    schema = _parameters(tools, name)
    args = {}
    for p in params:
        key = p.group(1).strip()
        value = p.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = _typed(value, schema.get(key))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _parameters(tools: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    """The JSON-schema properties of the tool called `name` (empty when unknown)."""
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return props if isinstance(props, dict) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """An XML parameter's text as the JSON value its schema types (text when it does not fit)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or "string" in types:
        return value
    v = value.strip()
    for t in types:
        if t == "integer" and re.fullmatch(r"-?\d+", v):
            return int(v)
        if t == "number":
            try:
                f = float(v)
                return int(v) if re.fullmatch(r"-?\d+", v) else f
            except ValueError:
                pass
        if t == "boolean" and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if t == "null" and v.lower() in ("null", "none"):
            return None
        if t in ("object", "array"):
            parsed = _json(v)
            if isinstance(parsed, dict if t == "object" else list):
                return parsed
    return value


class Llama3Json(ToolCallParser):
    """The output opens with a JSON call (after `<|python_tag|>` or nothing); `;` separates."""

    starts = ("<|python_tag|>", "{")
    anywhere = False
    separators = " \t\r\n;"
    _TAG = "<|python_tag|>"

    def begin_call(self) -> None:
        self._span: JsonSpan | None = None

    def call_end(self, buf: str) -> int | None:
        if self._span is None:
            at = len(self._TAG) if buf.startswith(self._TAG) else 0
            rest = buf[at:]
            lead = len(rest) - len(rest.lstrip(_WS))
            if lead == len(rest):
                return None
            if rest[lead] != "{":
                return at + lead  # the tag and no JSON object: malformed
            self._span = JsonSpan(at + lead)
        return self._span.end(buf)

    def decode(self, raw: str, closed: bool) -> list[ToolCall] | None:
        if not closed:
            return None
        obj = _json(raw.removeprefix(self._TAG))
        call = _call(obj, ("parameters", "arguments"))
        return [call] if call else None


class Mistral(ToolCallParser):
    starts = ("[TOOL_CALLS]",)
    _ARGS = "[ARGS]"
    _ID = "[CALL_ID]"

    def begin_call(self) -> None:
        self._span: JsonSpan | None = None

    def call_end(self, buf: str) -> int | None:
        if self._span is None:
            at = len(self.starts[0])
            rest = buf[at:]
            lead = len(rest) - len(rest.lstrip(_WS))
            if lead == len(rest):
                return None
            if rest[lead] in "[{":  # a JSON list of calls, or one call object
                self._span = JsonSpan(at + lead)
            else:
                args = buf.find(self._ARGS, at)
                if args < 0:
                    return None
                rest = buf[args + len(self._ARGS) :]
                lead = len(rest) - len(rest.lstrip(_WS))
                if lead == len(rest):
                    return None
                start = args + len(self._ARGS) + lead
                if rest[lead] != "{":
                    return start  # no arguments object: malformed
                self._span = JsonSpan(start)
        return self._span.end(buf)

    def decode(self, raw: str, closed: bool) -> list[ToolCall] | None:
        if not closed:
            return None
        body = raw[len(self.starts[0]) :]
        if body.lstrip(_WS)[:1] in ("[", "{"):
            obj = _json(body)
            items = obj if isinstance(obj, list) else [obj]
            calls = [_call(o) for o in items]
            return calls if calls and all(calls) else None  # type: ignore[return-value]
        name, _, args = body.partition(self._ARGS)
        name = name.split(self._ID)[0].strip(_WS)
        if not name or not re.fullmatch(r"[\w.\-]+", name):
            return None
        call = _call({"name": name, "arguments": _json(args)})
        return [call] if call else None
