"""An output as the block- and item-shaped APIs see it (Responses' items, Anthropic's content
blocks): reasoning, then text, then a call per parsed tool call, each growing as the engine's
outputs come, each token's entry in exactly one of them.

`Items.feed` turns one output into changes (an item opened, grown by text and entries, closed);
each API renders the changes as its own events, and a response that is not streamed is built
from the same changes of its one merged output, so both have the same items and entries.

Where entries go: reasoning tokens to the reasoning item, content tokens to the text item, and
the tool-call section (the calls, the framing between and after them, the end-of-turn token) to
the **first call**: the parser knows where that section starts, not where each call's tokens
end. So the first call stays open until the output ends (later tool-call tokens grow it with no
text); later calls open and close at once. Tool-call tokens with no call at all (a forced call
cut by the token limit) go to the text item.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omlx_logprobs.api.core.sections import sections
from omlx_logprobs.types import Entries, RequestOutput, ToolCall

REASONING, TEXT, CALL = "reasoning", "text", "call"


@dataclass(eq=False)
class Item:
    """One item while it grows; `id` and `call_id` are the API's to name."""

    kind: str  # REASONING, TEXT or CALL
    index: int  # its place in the output
    text: str = ""  # the reasoning or the text, or the call's arguments
    call: ToolCall | None = None
    blocks: list[Entries] = field(default_factory=list)
    holds_entries: bool = False  # entries were asked for and this item is one that gets them
    open: bool = True
    id: str = ""
    call_id: str = ""

    def entries(self) -> Entries | None:
        blocks = [b for b in self.blocks if len(b)]
        return Entries.concat(blocks) if blocks else None


@dataclass(frozen=True)
class Change:
    """An item opened, grown by `text` and the `block` of its tokens' entries (None: no
    entries asked for, or none in this step), or closed."""

    kind: str  # "open", "grow" or "close"
    item: Item
    text: str = ""
    block: Entries | None = None


class Items:
    def __init__(self, think: bool, logprobs: bool) -> None:
        self.think, self.logprobs = think, logprobs
        self.items: list[Item] = []
        self.first_call: Item | None = None

    def _open(self, kind: str, call: ToolCall | None = None) -> Change:
        item = Item(kind, len(self.items), call=call)
        item.holds_entries = self.logprobs and (kind != CALL or self.first_call is None)
        self.items.append(item)
        return Change("open", item)

    def _grow(self, item: Item, text: str, block: Entries | None) -> Change:
        item.text += text
        if not item.holds_entries:
            block = None
        if block is not None:
            item.blocks.append(block)
        return Change("grow", item, text, block)

    def _close(self, item: Item | None) -> list[Change]:
        if item is None or not item.open:
            return []
        item.open = False
        return [Change("close", item)]

    def _current(self, kind: str) -> Item | None:
        """The last item, if it is an open one of this kind."""
        last = self.items[-1] if self.items else None
        return last if last is not None and last.open and last.kind == kind else None

    def _find(self, kind: str) -> tuple[Item, list[Change]]:
        """The open item of this kind, or a new one (the one before it closed)."""
        item = self._current(kind)
        if item is not None:
            return item, []
        closing = self._close(self._current(REASONING)) + self._close(self._current(TEXT))
        opened = self._open(kind)
        return opened.item, [*closing, opened]

    def feed(self, out: RequestOutput) -> list[Change]:
        """The changes one output makes."""
        split = sections(out)
        changes: list[Change] = []
        if self.think and (out.reasoning_text or out.num_reasoning):
            item, opened = self._find(REASONING)
            block = split.reasoning if split else None
            changes += [*opened, self._grow(item, out.reasoning_text, block)]
        content_tokens = out.num_tokens - out.num_reasoning - out.num_tool
        orphans = bool(out.num_tool) and not out.tool_calls and self.first_call is None
        if out.text or content_tokens or orphans:
            item, opened = self._find(TEXT)
            block = split.content if split else None
            if orphans and split is not None:  # tool-call tokens with no call: the text's
                block = Entries.concat([split.content, split.tools])
            changes += [*opened, self._grow(item, out.text, block)]
        tools = split.tools if split is not None and out.num_tool and not orphans else None
        for call in out.tool_calls:
            changes += self._close(self._current(REASONING)) + self._close(self._current(TEXT))
            added = self._open(CALL, call)
            first = self.first_call is None
            block, tools = (tools, None) if first else (None, tools)
            changes += [added, self._grow(added.item, call.arguments, block)]
            if first:
                self.first_call = added.item  # open to the end: later tool tokens are its
            else:
                changes += self._close(added.item)
        if tools is not None and self.first_call is not None:
            changes.append(self._grow(self.first_call, "", tools))
        return changes

    def finish(self, text_if_empty: bool = True) -> list[Change]:
        """Every open item closed; an output with no item at all gets an empty text item."""
        changes = [self._open(TEXT)] if text_if_empty and not self.items else []
        for item in self.items:
            changes += self._close(item)
        return changes
