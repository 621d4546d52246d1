"""The prompt text each earlier answer was sampled after, rendered once per conversation start.

Splicing an answer back (api/core/splice.py) needs the template's text of the messages before
it; rendered anew for every answer of every request, that is a render per turn per turn, a
conversation's square (42 ms for the renders of the 50 answers of a 100-message one on the
2-core box). A
conversation's next request starts with the same messages, so each start's text is kept, found
by a digest chained over the messages (and the template's settings): a request renders only
the starts it has not seen. Bounded in characters, the least recently used going first."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

MAX_MIB = 32  # of kept texts (characters, about bytes)


def chained(settings: Any, messages: Iterable[dict[str, Any]]) -> list[bytes]:
    """Digest i names the settings and the messages before message i (i = 0 .. n)."""
    h = hashlib.blake2b(_json(settings), digest_size=16)
    out = [h.digest()]
    for m in messages:
        h.update(_json(m))
        out.append(h.digest())
    return out


def _json(value: Any) -> bytes:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    return text.encode("utf-8", "surrogatepass") + b"\x00"


class Heads:
    def __init__(self, mib: int = MAX_MIB) -> None:
        self.budget = mib << 20
        self._items: OrderedDict[bytes, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # requests are prepared on several threads

    def get(self, key: bytes, render: Callable[[], str | None]) -> str | None:
        """The text kept under `key`, else `render()`'s (kept unless None)."""
        with self._lock:
            text = self._items.get(key)
            if text is not None:
                self._items.move_to_end(key)
                return text
        text = render()
        if text is None or len(text) > self.budget:
            return text
        with self._lock:
            if key not in self._items:
                self._items[key] = text
                self._chars += len(text)
            while self._chars > self.budget:
                _, old = self._items.popitem(last=False)
                self._chars -= len(old)
        return text

    def __len__(self) -> int:
        return len(self._items)
