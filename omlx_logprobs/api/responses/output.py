"""A response's output items, built from the engine's outputs as they come, and the Responses
events that tell a stream about them. A response that is not streamed is built the same way
from its one merged output, so both have the same items and entries.

Items, in the order their text comes: a `reasoning` item (the thinking parser's reasoning, its
tokens' entries as the `reasoning_text` part's `logprobs`), a `message` (content, its tokens'
entries as the `output_text` part's `logprobs`: OpenAI's place), then a `function_call` per
parsed call. Every generated token's entry is in exactly one item, in order: the tool-call
tokens (the calls, the framing between and after them, the end-of-turn token) are the first
call's `logprobs`, since the parser knows where the section starts, not where each call's
tokens end; tool-call tokens with no call at all (a forced call cut by `max_output_tokens`)
are the message's. A stream keeps the first call's item open until the end for that reason:
later tool-call tokens come as `response.function_call_arguments.delta` events on it with an
empty `delta`.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from omlx_logprobs.api import sections, sse, tools
from omlx_logprobs.api.prepare import Prepared
from omlx_logprobs.api.response import weight_version_json
from omlx_logprobs.types import Entries, FinishReason, RequestOutput, ThinkStart, ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _raw(obj: dict[str, Any], **raw: str) -> str:
    """obj as JSON with more keys whose values are JSON text already (entry lists)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    extra = "".join(f',"{k}":{v}' for k, v in raw.items())
    return text[:-1] + extra + "}"


@dataclass
class Item:
    """One output item while it grows."""

    kind: str  # reasoning, message, function_call
    id: str
    index: int  # output_index
    text: str = ""  # the reasoning or message text, or the call's arguments
    call: ToolCall | None = None
    call_id: str = ""
    blocks: list[Entries] = field(default_factory=list)
    carries_logprobs: bool = False  # written with a `logprobs` key
    open: bool = True


class ResponseOutput:
    """One response's items and, when streamed, its events (`feed`, `finish`)."""

    def __init__(self, p: Prepared, meta: dict[str, Any], streamed: bool) -> None:
        self.p, self.meta, self.streamed = p, meta, streamed
        self.logprobs = p.first.params.logprobs
        self.think = p.first.think is not ThinkStart.OFF
        self.items: list[Item] = []
        self.seq = 0
        self.ids = tools.CallIds(p.first.tools.parser if p.first.tools else None)
        self.first_call: Item | None = None
        self.weights = ""
        self.body = ""  # the whole response, once finished

    # ---- events ---------------------------------------------------------------------------
    def _event(self, kind: str, raw: dict[str, str] | None = None, **fields: Any) -> str:
        if not self.streamed:
            return ""
        body = _raw({"type": kind, "sequence_number": self.seq, **fields}, **(raw or {}))
        self.seq += 1
        return sse.event(kind, body)

    def created(self, out: RequestOutput) -> list[str]:
        """The first events, once the first output names the weights."""
        self.weights = weight_version_json(out.weight_version)
        body = self.response("in_progress", None, None)
        return [
            self._event("response.created", {"response": body}),
            self._event("response.in_progress", {"response": body}),
        ]

    # ---- the items ------------------------------------------------------------------------
    def _entries(self, item: Item) -> str:
        blocks = [b for b in item.blocks if len(b)]
        e = Entries.concat(blocks) if blocks else None
        return self.p.writer.entries(e)

    def item_json(self, item: Item) -> str:
        status = "in_progress" if item.open else self.item_status
        lp = {"logprobs": self._entries(item)} if item.carries_logprobs else {}
        if item.kind == "reasoning":
            part = _raw({"type": "reasoning_text", "text": item.text}, **lp)
            return _raw(
                {"id": item.id, "type": "reasoning", "summary": [], "status": status},
                content=f"[{part}]" if not item.open else "[]",
            )
        if item.kind == "message":
            part = self._part(item, closing=True)
            return _raw(
                {"id": item.id, "type": "message", "role": "assistant", "status": status},
                content=f"[{part}]" if not item.open else "[]",
            )
        assert item.call is not None
        args = item.call.arguments if not item.open else ""
        fc = {"id": item.id, "type": "function_call", "call_id": item.call_id,
              "name": item.call.name, "arguments": args, "status": status}  # fmt: skip
        return _raw(fc, **(lp if not item.open else {}))

    def _part(self, item: Item, closing: bool) -> str:
        """The message's output_text part: empty when added, whole when done."""
        text = item.text if closing else ""
        lp = self._entries(item) if closing and item.carries_logprobs else "[]"
        return _raw({"type": "output_text", "text": text, "annotations": []}, logprobs=lp)

    @property
    def item_status(self) -> str:
        return "incomplete" if self.meta.get("status") == "incomplete" else "completed"

    def _open(self, kind: str, call: ToolCall | None = None) -> tuple[Item, list[str]]:
        """A new item, and the events that add it."""
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = Item(kind, _id(prefix), len(self.items), call=call)
        item.carries_logprobs = self.logprobs and (kind != "function_call" or not self.first_call)
        if call is not None:
            item.call_id = self.ids.new_id()
        self.items.append(item)
        events = [self._event("response.output_item.added", {"item": self.item_json(item)},
                              output_index=item.index)]  # fmt: skip
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            events.append(self._part_event("response.content_part.added", item, part))
        elif kind == "message":
            raw = {"part": self._part(item, closing=False)}
            events.append(self._event("response.content_part.added", raw, **self._where(item)))
        return item, events

    def _where(self, item: Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    def _part_event(self, kind: str, item: Item, part: dict[str, Any]) -> str:
        return self._event(kind, None, part=part, **self._where(item))

    def _close(self, item: Item | None) -> list[str]:
        """The events that finish an item (its whole text, its entries)."""
        if item is None or not item.open:
            return []
        item.open = False
        events = []
        lp = {"logprobs": self._entries(item)} if item.carries_logprobs else {}
        if item.kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", None, text=item.text,
                                      **self._where(item)))  # fmt: skip
            part = _raw({"type": "reasoning_text", "text": item.text}, **lp)
            events.append(self._event("response.content_part.done", {"part": part},
                                      **self._where(item)))  # fmt: skip
        elif item.kind == "message":
            text_lp = lp or {"logprobs": "[]"}
            events.append(self._event("response.output_text.done", text_lp, text=item.text,
                                      **self._where(item)))  # fmt: skip
            raw = {"part": self._part(item, closing=True)}
            events.append(self._event("response.content_part.done", raw, **self._where(item)))
        else:
            assert item.call is not None
            call = {"name": item.call.name, "arguments": item.call.arguments}
            where = {"item_id": item.id, "output_index": item.index}
            done = self._event("response.function_call_arguments.done", None, **where, **call)
            events.append(done)
        events.append(self._event("response.output_item.done", {"item": self.item_json(item)},
                                  output_index=item.index))  # fmt: skip
        return events

    def _current(self, kind: str) -> Item | None:
        """The last item if it is an open one of this kind."""
        last = self.items[-1] if self.items else None
        return last if last is not None and last.open and last.kind == kind else None

    # ---- outputs --------------------------------------------------------------------------
    def feed(self, out: RequestOutput) -> list[str]:
        """The events of one output; its text and entries added to the items."""
        split = sections.sections(out)
        events: list[str] = []
        if self.think and (out.reasoning_text or out.num_reasoning):
            item = self._current("reasoning")
            if item is None:
                item, added = self._open("reasoning")
                events += added
            item.text += out.reasoning_text
            events += self._delta("response.reasoning_text.delta", item, out.reasoning_text,
                                  split.reasoning if split else None)  # fmt: skip
        content_tokens = out.num_tokens - out.num_reasoning - out.num_tool
        orphans = out.num_tool and not out.tool_calls and self.first_call is None
        if out.text or content_tokens or orphans:
            item = self._current("message")
            if item is None:
                events += self._close(self._current("reasoning"))
                item, added = self._open("message")
                events += added
            item.text += out.text
            block = split.content if split else None
            if orphans and split is not None:  # tool-call tokens with no call: the message's
                block = Entries.concat([split.content, split.tools])
            events += self._delta("response.output_text.delta", item, out.text, block)
        tools_block = split.tools if split is not None and out.num_tool and not orphans else None
        for call in out.tool_calls:
            events += self._close(self._current("reasoning"))
            events += self._close(self._current("message"))
            item, added = self._open("function_call", call)
            events += added
            first = self.first_call is None
            block, tools_block = (tools_block, None) if first else (None, tools_block)
            events += self._delta("response.function_call_arguments.delta", item,
                                  call.arguments, block)  # fmt: skip
            if first:
                self.first_call = item  # open to the end: later tool-call tokens are its
            else:
                events += self._close(item)
        if tools_block is not None and self.first_call is not None:
            events += self._delta("response.function_call_arguments.delta", self.first_call,
                                  "", tools_block)  # fmt: skip
        return events

    def _delta(self, kind: str, item: Item, text: str, block: Entries | None) -> list[str]:
        if block is not None and item.carries_logprobs:
            item.blocks.append(block)
            raw = {"logprobs": self.p.writer.entries(block)}
        else:
            raw = {"logprobs": "[]"} if kind == "response.output_text.delta" else {}
        if kind == "response.function_call_arguments.delta":
            return [self._event(kind, raw, item_id=item.id, output_index=item.index, delta=text)]
        return [self._event(kind, raw, delta=text, **self._where(item))]

    def finish(self, last: RequestOutput) -> list[str]:
        """The events that close every item and end the response (completed, incomplete at
        `max_output_tokens`, failed on an engine error); `body` is the whole response."""
        if last.error:
            status, error = "failed", {"code": "server_error", "message": last.error}
        elif last.finish_reason is FinishReason.LENGTH:
            status, error = "incomplete", None
        else:
            status, error = "completed", None
        self.meta["status"] = status
        if status == "incomplete":
            self.meta["incomplete_details"] = {"reason": "max_output_tokens"}
        self.meta["error"] = error
        events: list[str] = []
        if not self.items and status != "failed":  # an answer with no text is still a message
            _, added = self._open("message")
            events += added
        for item in self.items:
            events += self._close(item)
        self.body = self.response(status, last, self.items)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[status]  # fmt: skip
        return [*events, self._event(kind, {"response": self.body})]

    def response(self, status: str, last: RequestOutput | None, items: list[Item] | None) -> str:
        meta = {**self.meta, "status": status}
        output = ",".join(self.item_json(i) for i in items or [])
        usage = "null" if last is None else json.dumps(_usage(last, self.think))
        return _raw(meta, output=f"[{output}]", usage=usage)[:-1] + self.weights + "}"


def _usage(out: RequestOutput, think: bool) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_tokens, "cache_write_tokens": 0},
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
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        **req_fields,
    }
