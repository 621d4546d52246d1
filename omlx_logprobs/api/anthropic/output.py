"""A message's content blocks and Anthropic's stream events, rendered from the changes
api/core/items.py makes of the engine's outputs (a message that is not streamed is built from the
same changes of its one merged output).

Blocks: `thinking` (the reasoning; `signature` is empty: nothing here signs it), `text`, a
`tool_use` per parsed call (`input`: its arguments). With `logprobs` (this server's extension)
each block carries its tokens' entries (`logprobs`; the tool-call section on the first
`tool_use`, which a stream keeps open until the end) and each `content_block_delta` the entries
of its own tokens."""

from __future__ import annotations

import json
import secrets
from typing import Any

from omlx_logprobs.api.core import sse
from omlx_logprobs.api.core.items import CALL, REASONING, TEXT, Change, Item, Items
from omlx_logprobs.api.core.prepare import Prepared
from omlx_logprobs.api.core.sections import dumps
from omlx_logprobs.types import FinishReason, RequestOutput, ThinkStart
from omlx_logprobs.vocab import Vocabulary

BLOCKS = {REASONING: "thinking", TEXT: "text", CALL: "tool_use"}
DELTAS = {REASONING: ("thinking_delta", "thinking"), TEXT: ("text_delta", "text"),
          CALL: ("input_json_delta", "partial_json")}  # fmt: skip


def _json(obj: Any) -> str:
    return dumps(obj)


class MessageOutput:
    """One message's blocks and, when streamed, its events (`start`, `feed`, `finish`)."""

    def __init__(self, p: Prepared, streamed: bool, stops: list[str], vocab: Vocabulary) -> None:
        self.p, self.streamed, self.stops, self.vocab = p, streamed, stops, vocab
        self.items = Items(p.first.think is not ThinkStart.OFF, p.first.params.logprobs)
        self.token_ids: list[int] = []
        self.body = ""

    def _event(self, kind: str, body: str) -> str:
        return sse.event(kind, body) if self.streamed else ""

    def _head(self, out: RequestOutput, content: str, stop: tuple[str | None, str | None]) -> str:
        reason, sequence = stop
        meta = {"id": self.p.request_id, "type": "message", "role": "assistant",
                "model": self.p.model}  # fmt: skip
        tail = {
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(out, self.p.reused),
        }
        return _json(meta)[:-1] + f',"content":{content},' + _json(tail)[1:]

    def start(self, out: RequestOutput) -> list[str]:
        head = self._head(out, "[]", (None, None))
        return [self._event("message_start", f'{{"type":"message_start","message":{head}}}')]

    def feed(self, out: RequestOutput) -> list[str]:
        self.token_ids += out.token_ids.tolist()
        return [e for c in self.items.feed(out) for e in self._render(c)]

    def finish(self, last: RequestOutput) -> list[str]:
        """Every block closed, then `message_delta` (why it stopped, the output's count) and
        `message_stop`; `body` is the whole message."""
        events = [e for c in self.items.finish() for e in self._render(c)]
        stop = self.stop_reason(last)
        blocks = ",".join(self.block(i) for i in self.items.items)
        self.body = self._head(last, f"[{blocks}]", stop)
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                 "usage": {"output_tokens": last.completion_tokens}}  # fmt: skip
        return [*events, self._event("message_delta", _json(delta)),
                self._event("message_stop", '{"type":"message_stop"}')]  # fmt: skip

    def stop_reason(self, last: RequestOutput) -> tuple[str, str | None]:
        """Anthropic's: `max_tokens`, `tool_use`, `stop_sequence` (which one: the stop string
        that ends within the last token), else `end_turn`."""
        if last.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        if any(i.kind == CALL for i in self.items.items):
            return "tool_use", None
        matched = matched_stop(self.token_ids, self.vocab, self.stops)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    # ---- blocks and events ---------------------------------------------------------------------
    def _entries(self, item: Item) -> str:
        return f',"logprobs":{self.p.writer.entries(item.entries())}' if item.holds_entries else ""

    def block(self, item: Item, whole: bool = True) -> str:
        if item.kind == REASONING:
            b: dict[str, Any] = {"type": "thinking", "thinking": item.text if whole else "",
                                 "signature": ""}  # fmt: skip
        elif item.kind == TEXT:
            b = {"type": "text", "text": item.text if whole else ""}
        else:
            assert item.call is not None
            b = {"type": "tool_use", "id": item.id, "name": item.call.name,
                 "input": _input(item.call.arguments) if whole else {}}  # fmt: skip
        return _json(b)[:-1] + (self._entries(item) if whole else "") + "}"

    def _render(self, c: Change) -> list[str]:
        item = c.item
        if c.kind == "open":
            item.id = f"toolu_{secrets.token_hex(12)}" if item.kind == CALL else ""
            body = f'{{"type":"content_block_start","index":{item.index},' \
                   f'"content_block":{self.block(item, whole=False)}}}'  # fmt: skip
            return [self._event("content_block_start", body)]
        if c.kind == "close":
            events = []
            if item.kind == REASONING:
                sig = {"type": "content_block_delta", "index": item.index,
                       "delta": {"type": "signature_delta", "signature": ""}}  # fmt: skip
                events.append(self._event("content_block_delta", _json(sig)))
            stop = f'{{"type":"content_block_stop","index":{item.index}}}'
            return [*events, self._event("content_block_stop", stop)]
        kind, key = DELTAS[item.kind]
        delta = {"type": "content_block_delta", "index": item.index,
                 "delta": {"type": kind, key: c.text}}  # fmt: skip
        lp = f',"logprobs":{self.p.writer.entries(c.block)}' if c.block is not None else ""
        return [self._event("content_block_delta", _json(delta)[:-1] + lp + "}")]


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is (text that is no object is
    kept under `arguments`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _usage(out: RequestOutput, reused: int) -> dict[str, int]:
    """Anthropic counts the prompt tokens read from a cache apart from the input;
    `reused_output_tokens` (this server's): the prompt tokens that are earlier answers' sampled
    ids, sent back (api/core/splice.py), wherever they were read from."""
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "output_tokens": out.completion_tokens,
        "cache_read_input_tokens": out.cached_tokens,
        "cache_creation_input_tokens": 0,
        "reused_output_tokens": reused,
    }


def matched_stop(ids: list[int], vocab: Vocabulary, stops: list[str]) -> str | None:
    """The stop string that ended the output: the earliest-starting one that ends within the
    last token's text (a stop string ends generation at the token that completes it)."""
    if not ids or not stops:
        return None
    pieces = [vocab.token_bytes[t] or b"" if t < len(vocab) else b"" for t in ids]
    raw = b"".join(pieces).decode("utf-8", errors="replace")
    last = len(pieces[-1].decode("utf-8", errors="replace"))
    if not last:
        return None  # a token with no text (end of turn) ended it
    found = []
    for s in stops:
        at = raw.rfind(s)
        if at >= 0 and at + len(s) > len(raw) - last:
            found.append((at, s))
    return min(found)[1] if found else None
