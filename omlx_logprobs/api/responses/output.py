"""A response's output items and the Responses events that tell a stream about them, rendered
from the changes api/core/items.py makes of the engine's outputs (a response that is not streamed is
built from the same changes of its one merged output, so both have the same items).

Items: a `reasoning` item (its tokens' entries as the `reasoning_text` part's `logprobs`, an
extension), a `message` (its tokens' entries as the `output_text` part's `logprobs`: OpenAI's
place), a `function_call` per parsed call (the tool-call section's entries as the first call's
`logprobs`, an extension). Deltas carry the entries of their own tokens: `output_text.delta`
in OpenAI's `logprobs`, `reasoning_text.delta` and `function_call_arguments.delta` in the same
key; later tool-call tokens come as `function_call_arguments.delta` events on the first call
with an empty `delta` (it stays open until the response ends).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from omlx_logprobs.api.core import sse, tools
from omlx_logprobs.api.core.items import CALL, REASONING, TEXT, Change, Item, Items
from omlx_logprobs.api.core.prepare import Prepared
from omlx_logprobs.api.core.response import weight_version_json
from omlx_logprobs.api.core.sections import dumps
from omlx_logprobs.types import FinishReason, RequestOutput, ThinkStart


def _raw(obj: dict[str, Any], **raw: str) -> str:
    """obj as JSON with more keys whose values are JSON text already (entry lists)."""
    text = dumps(obj)
    extra = "".join(f',"{k}":{v}' for k, v in raw.items())
    return text[:-1] + extra + "}"


class ResponseOutput:
    """One response's items and, when streamed, its events (`feed`, `finish`)."""

    def __init__(self, p: Prepared, meta: dict[str, Any], streamed: bool) -> None:
        self.p, self.meta, self.streamed = p, meta, streamed
        self.think = p.first.think is not ThinkStart.OFF
        self.items = Items(self.think, p.first.params.logprobs)
        self.seq = 0
        self.ids = tools.CallIds(p.first.tools.parser if p.first.tools else None)
        self.weights = ""
        self.body = ""  # the whole response, once finished

    def _event(self, kind: str, raw: dict[str, str] | None = None, **fields: Any) -> str:
        if not self.streamed:
            return ""
        body = _raw({"type": kind, "sequence_number": self.seq, **fields}, **(raw or {}))
        self.seq += 1
        return sse.event(kind, body)

    def created(self, out: RequestOutput) -> list[str]:
        """The first events, once the first output names the weights."""
        self.weights = weight_version_json(out.weight_version, out.adapter)
        body = self.response("in_progress", None)
        return [
            self._event("response.created", {"response": body}),
            self._event("response.in_progress", {"response": body}),
        ]

    def feed(self, out: RequestOutput) -> list[str]:
        return [e for c in self.items.feed(out) for e in self._render(c)]

    def finish(self, last: RequestOutput) -> list[str]:
        """The events that close every item and end the response (completed, incomplete at
        `max_output_tokens`, failed on an engine error); `body` is the whole response."""
        if last.error:
            status, error = "failed", {"code": "server_error", "message": last.error}
        elif last.finish_reason is FinishReason.LENGTH:
            status, error = "incomplete", None
        else:
            status, error = "completed", None
        done = int(time.time()) if status == "completed" else None
        self.meta.update(status=status, error=error, completed_at=done)
        if status == "incomplete":
            self.meta["incomplete_details"] = {"reason": "max_output_tokens"}
        changes = self.items.finish(text_if_empty=status != "failed")
        events = [e for c in changes for e in self._render(c)]
        self.body = self.response(status, last)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[status]  # fmt: skip
        return [*events, self._event(kind, {"response": self.body})]

    # ---- the JSON ----------------------------------------------------------------------------
    def response(self, status: str, last: RequestOutput | None) -> str:
        meta = {**self.meta, "status": status}
        output = ",".join(self.item_json(i) for i in self.items.items) if last else ""
        usage = "null" if last is None else json.dumps(_usage(last, self.think, self.p.reused))
        return _raw(meta, output=f"[{output}]", usage=usage)[:-1] + self.weights + "}"

    def _entries(self, item: Item) -> dict[str, str]:
        return {"logprobs": self.p.writer.entries(item.entries())} if item.holds_entries else {}

    def _part(self, item: Item) -> str:
        """A reasoning or message item's one content part: empty while open, whole after."""
        text = "" if item.open else item.text
        lp = self._entries(item) if not item.open else {}
        if item.kind == REASONING:
            return _raw({"type": "reasoning_text", "text": text}, **lp)
        return _raw({"type": "output_text", "text": text, "annotations": []},
                    logprobs=lp.get("logprobs", "[]"))  # fmt: skip

    def item_json(self, item: Item) -> str:
        status = "in_progress" if item.open else self._item_status
        if item.kind == REASONING:
            content = "[]" if item.open else f"[{self._part(item)}]"
            meta = {"id": item.id, "type": "reasoning", "summary": [], "status": status}
            return _raw(meta, content=content)
        if item.kind == TEXT:
            content = "[]" if item.open else f"[{self._part(item)}]"
            meta = {"id": item.id, "type": "message", "role": "assistant", "status": status}
            return _raw(meta, content=content)
        assert item.call is not None
        fc = {"id": item.id, "type": "function_call", "call_id": item.call_id,
              "name": item.call.name, "arguments": "" if item.open else item.call.arguments,
              "status": status}  # fmt: skip
        return _raw(fc, **({} if item.open else self._entries(item)))

    @property
    def _item_status(self) -> str:
        return "incomplete" if self.meta.get("status") == "incomplete" else "completed"

    # ---- the events --------------------------------------------------------------------------
    def _render(self, c: Change) -> list[str]:
        item = c.item
        if c.kind == "open":
            return self._added(item)
        if c.kind == "close":
            return self._done(item)
        where = {"item_id": item.id, "output_index": item.index}
        raw = {"logprobs": self.p.writer.entries(c.block)} if c.block is not None else {}
        if item.kind == CALL:
            return [self._event("response.function_call_arguments.delta", raw, **where,
                                delta=c.text)]  # fmt: skip
        if item.kind == REASONING:
            return [self._event("response.reasoning_text.delta", raw, **where,
                                content_index=0, delta=c.text)]  # fmt: skip
        raw = raw or {"logprobs": "[]"}  # OpenAI's delta always has the key
        return [self._event("response.output_text.delta", raw, **where, content_index=0,
                            delta=c.text)]  # fmt: skip

    def _added(self, item: Item) -> list[str]:
        prefix = {REASONING: "rs", TEXT: "msg", CALL: "fc"}[item.kind]
        item.id = f"{prefix}_{secrets.token_hex(16)}"
        if item.kind == CALL:
            item.call_id = self.ids.new_id()
        events = [self._event("response.output_item.added", {"item": self.item_json(item)},
                              output_index=item.index)]  # fmt: skip
        if item.kind != CALL:
            where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            events.append(self._event("response.content_part.added",
                                      {"part": self._part(item)}, **where))  # fmt: skip
        return events

    def _done(self, item: Item) -> list[str]:
        where = {"item_id": item.id, "output_index": item.index}
        events = []
        if item.kind == CALL:
            assert item.call is not None
            call = {"name": item.call.name, "arguments": item.call.arguments}
            events.append(self._event("response.function_call_arguments.done", None,
                                      **where, **call))  # fmt: skip
        else:
            kind = "reasoning_text" if item.kind == REASONING else "output_text"
            lp = self._entries(item)
            if item.kind == TEXT:
                lp = lp or {"logprobs": "[]"}
            events.append(self._event(f"response.{kind}.done", lp, **where, content_index=0,
                                      text=item.text))  # fmt: skip
            events.append(self._event("response.content_part.done", {"part": self._part(item)},
                                      **where, content_index=0))  # fmt: skip
        events.append(self._event("response.output_item.done", {"item": self.item_json(item)},
                                  output_index=item.index))  # fmt: skip
        return events


def _usage(out: RequestOutput, think: bool, reused: int) -> dict[str, Any]:
    """`reused_output_tokens`: input tokens that are earlier answers' sampled ids, sent back
    (api/core/splice.py)."""
    details = {"cached_tokens": out.cached_tokens, "cache_write_tokens": 0,
               "reused_output_tokens": reused}  # fmt: skip
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens if think else 0},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def meta(req_fields: dict[str, Any], response_id: str, model: str) -> dict[str, Any]:
    """The response's fields other than its output and usage."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "completed_at": None,  # set when the response completes (output.finish)
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        **req_fields,
    }
