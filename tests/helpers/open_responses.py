"""The Open Responses specification's published schema, read as the compliance suite reads it.

The suite (openresponses/openresponses, `bin/compliance-test.ts`) parses every response with
zod schemas that kubb generates from the specification's OpenAPI document, and every streamed
event with the union of the streaming-event schemas. It is published only in that repository
(no npm or PyPI package ships it), so here the same OpenAPI document is read from a registry
package: openresponses-py ships the dated release (`openresponses/openapi/<date>.json`). Its
schemas are JSON Schema 2020-12; kubb writes `oneOf` as `z.union`, which takes the first variant
that matches, so a union is checked here as `anyOf` (two variants that both match are no error
to zod)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import httpx
from jsonschema import Draft202012Validator

SPEC_VERSION = "2026-04-24"


def _unions_as_any_of(node: Any) -> Any:
    if isinstance(node, dict):
        return {("anyOf" if k == "oneOf" else k): _unions_as_any_of(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unions_as_any_of(v) for v in node]
    return node


class Spec:
    """The OpenAPI document's response and streaming-event schemas as validators."""

    def __init__(self, version: str = SPEC_VERSION) -> None:
        path = resources.files("openresponses") / "openapi" / f"{version}.json"
        doc = json.loads(path.read_text())
        assert doc["info"]["version"] == version
        components = _unions_as_any_of(doc["components"])
        content = doc["paths"]["/responses"]["post"]["responses"]["200"]["content"]
        self.response = self._validator(content["application/json"]["schema"], components)
        self.event = self._validator(content["text/event-stream"]["schema"], components)
        compact = doc["paths"]["/responses/compact"]["post"]["responses"]["200"]["content"]
        self.compacted = self._validator(compact["application/json"]["schema"], components)
        # WebSocket mode: the suite checks each message it sends as a `response.create`, and
        # each it receives as a streaming event or the WebSocket error envelope.
        self.create = self._validator(_ref("WebSocketResponseCreateEvent"), components)
        socket_event = {"anyOf": [content["text/event-stream"]["schema"],
                                  _ref("WebSocketErrorEvent")]}  # fmt: skip
        self.socket_event = self._validator(socket_event, components)

    @staticmethod
    def _validator(schema: dict[str, Any], components: dict[str, Any]) -> Draft202012Validator:
        return Draft202012Validator({**_unions_as_any_of(schema), "components": components})

    def response_errors(self, body: Any) -> list[str]:
        return [_say(e) for e in self.response.iter_errors(body)]

    def event_errors(self, event: Any, socket: bool = False) -> list[str]:
        kind = event.get("type") if isinstance(event, dict) else None
        validator = self.socket_event if socket else self.event
        return [f"event {kind}: {_say(e)}" for e in validator.iter_errors(event)]

    def compacted_errors(self, body: Any) -> list[str]:
        return [_say(e) for e in self.compacted.iter_errors(body)]

    def create_errors(self, message: Any) -> list[str]:
        return [f"WebSocket request {_say(e)}" for e in self.create.iter_errors(message)]


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _say(error: Any) -> str:
    """The path and message; for a union, the complaints of the variants whose `type` the
    value has (the variant it was meant as), or that no variant has its `type`."""
    where = ".".join(str(p) for p in error.absolute_path) or "root"
    if not error.context:
        return f"{where}: {error.message[:300]}"
    by_variant: dict[Any, list[Any]] = {}
    for e in error.context:
        by_variant.setdefault(e.relative_schema_path[0], []).append(e)
    depth = len(error.absolute_path) + 1
    meant = [errs for errs in by_variant.values()
             if not any(list(e.absolute_path)[depth - 1:] == ["type"] for e in errs)]  # fmt: skip
    if not meant:
        return f"{where}: no variant of the union has this `type`"
    inner = "; ".join(_say(e) for e in meant[0])
    return f"{where}: matches no variant of the union; as its `type`'s variant: {inner}"


@dataclass
class Stream:
    """A streamed response as the suite reads it: every `data:` payload (the `[DONE]` sentinel
    aside), the errors of the events that match no streaming-event schema, and the response of
    the last `response.completed`, `failed` or `incomplete` event."""

    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: Any = None

    @classmethod
    def read(cls, r: httpx.Response, spec: Spec) -> Stream:
        out = cls()
        for block in r.text.split("\n\n"):
            data = [line[5:].strip() for line in block.split("\n") if line.startswith("data:")]
            if not data or data[-1] == "[DONE]":
                continue
            event = json.loads(data[-1])
            out.events.append(event)
            out.errors += spec.event_errors(event)
            if event.get("type") in (
                "response.completed",
                "response.failed",
                "response.incomplete",
            ):
                out.final = event.get("response")
        return out
