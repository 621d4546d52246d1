"""Stored responses (`store`, on by default as OpenAI's), in memory and bounded: at most
`count` of them and `mib` MiB of their bodies and conversations together; the least recently
used goes first. `GET /v1/responses/{id}` returns a body, `previous_response_id` continues a
conversation, `DELETE` forgets one. Nothing survives a restart."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    body: str  # the response as it was returned (JSON)
    conversation: tuple[dict[str, Any], ...]  # its messages, instructions aside, and its output
    size: int  # bytes, about: the body, the conversation as JSON and the answers' ids
    # The ids each answer of the conversation that this server sampled was sampled as, by the
    # message's index in `conversation`: a continuation sends them back (api/core/splice.py).
    answers: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @staticmethod
    def of(
        body: str,
        conversation: list[dict[str, Any]],
        answers: tuple[tuple[int, tuple[int, ...]], ...] = (),
    ) -> Stored:
        ids = 4 * sum(len(a) for _, a in answers)
        size = len(body) + len(json.dumps(conversation)) + ids
        return Stored(body, tuple(conversation), size, answers)


class ResponseStore:
    def __init__(self, count: int = 256, mib: int = 64) -> None:
        self.count, self.budget = count, mib << 20
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, stored: Stored) -> None:
        """Keep it (a body larger than the whole budget is not kept)."""
        size = stored.size
        if size > self.budget or not self.count:
            return
        self.delete(response_id)
        self._items[response_id] = stored
        self._bytes += size
        while len(self._items) > self.count or self._bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.size

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored is not None

    def __len__(self) -> int:
        return len(self._items)

    def report(self) -> dict[str, Any]:
        """/health's `responses_store`: what is held against its bounds."""
        return {
            "responses": len(self._items),
            "bytes": self._bytes,
            "max_responses": self.count,
            "max_bytes": self.budget,
        }
