"""The token ids each assistant answer was sampled as, remembered so that a conversation sent back
keeps them (api/core/splice.py puts them in the next prompt instead of the text's own tokens).

An answer is found again by the assistant message a client sends back: its content, its reasoning
and its calls (name and arguments, the arguments as JSON values, so that an API which returns
them as an object, as Anthropic's `input`, finds them too), as every API reads them into the chat
messages. One store per served model, each adapter apart; bounded in answers and in bytes, the
least recently used going first, like the Responses store. Nothing survives a restart."""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omlx_logprobs.config import ServerConfig
from omlx_logprobs.types import RequestOutput

MAX_ANSWERS = ServerConfig.faithful_answers
MAX_MIB = 64


def message_key(
    content: str | None, reasoning: str | None, calls: Iterable[tuple[str, Any]]
) -> str:
    """What finds an answer again: the same for the message as returned and as sent back."""
    said = [[name, _arguments(args)] for name, args in calls]
    return json.dumps([content or "", reasoning or "", said], ensure_ascii=False)


def _arguments(args: Any) -> Any:
    """A call's arguments as a JSON value (text that is no JSON stays text)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def chat_message_key(message: dict[str, Any]) -> str:
    """The key of an assistant message as chat templates read it (api/core/tools.py)."""
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    return message_key(message.get("content"), message.get("reasoning_content"), calls)


class SampledStore:
    """Sampled ids by (adapter, message key); `count` answers and `mib` MiB at most."""

    def __init__(self, count: int = MAX_ANSWERS, mib: int = MAX_MIB) -> None:
        self.count, self.budget = count, mib << 20
        self._items: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # requests are prepared on several threads

    @staticmethod
    def _size(key: tuple[str, str], ids: array[int]) -> int:
        # (a call's arguments may hold half a surrogate pair: api/core/sections.py)
        return len(key[1].encode("utf-8", "surrogatepass")) + ids.itemsize * len(ids)

    def put(self, scope: str, key: str, ids: list[int]) -> None:
        """Keep them (an answer larger than the whole budget is not kept); the latest answer of
        a text replaces an earlier one."""
        where, kept = (scope, key), array("i", ids)
        size = self._size(where, kept)
        if size > self.budget or not self.count or not ids:
            return
        with self._lock:
            old = self._items.pop(where, None)
            if old is not None:
                self._bytes -= self._size(where, old)
            self._items[where] = kept
            self._bytes += size
            while len(self._items) > self.count or self._bytes > self.budget:
                gone, ids_gone = self._items.popitem(last=False)
                self._bytes -= self._size(gone, ids_gone)

    def get(self, scope: str, key: str) -> list[int] | None:
        with self._lock:
            ids = self._items.get((scope, key))
            if ids is None:
                return None
            self._items.move_to_end((scope, key))
            return ids.tolist()

    def __len__(self) -> int:
        return len(self._items)

    def report(self) -> dict[str, int]:
        """/health's `sampled_store`: what is held against its bounds."""
        return {
            "answers": len(self._items),
            "bytes": self._bytes,
            "max_answers": self.count,
            "max_bytes": self.budget,
        }


@dataclass
class _Answer:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


class Recorder:
    """One request's choices as their outputs arrive (streamed deltas or a merged whole); each
    finished choice's ids remembered under its message's key."""

    def __init__(self, store: SampledStore, scope: str) -> None:
        self.store, self.scope = store, scope
        self.answers: dict[int, _Answer] = {}
        self.sampled: dict[int, list[int]] = {}  # each finished choice's ids, by its index

    def heard(self, out: RequestOutput) -> None:
        a = self.answers.setdefault(out.index, _Answer())
        a.ids += out.token_ids.tolist()
        a.text += out.text
        a.reasoning += out.reasoning_text
        a.calls += [(c.name, c.arguments) for c in out.tool_calls]
        if out.finished:
            del self.answers[out.index]
            if not out.error:
                self.sampled[out.index] = a.ids
                self.store.put(self.scope, message_key(a.text, a.reasoning, a.calls), a.ids)
