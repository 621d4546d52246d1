"""Which kept token sequence shares the longest start with a prompt: the prefix cache's index,
in memory and on disk alike.

Each kept sequence's starts are hashed at every multiple of BLOCK (a chain of block hashes, as
vLLM's automatic prefix caching keys its blocks); a lookup walks the prompt's blocks until one
misses, then compares tokens one by one past the last hit. Plain Python: no model, no mlx.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

BLOCK = 8  # the index's granularity
MIN_TOKENS = 16  # shorter shared starts are not worth keeping or looking up
# Items of one block compared past it for the longest start (many conversations may share a
# system turn: the most recent ones are the likely continuations).
CANDIDATES = 64

T = TypeVar("T")


def block_hashes(ids: Sequence[int], limit: int) -> list[int]:
    """The chain hash of each whole block of ids[:limit]: entry j covers ids[: (j + 1) BLOCK]."""
    out, h = [], 0
    for j in range(0, limit - BLOCK + 1, BLOCK):
        h = hash((h, tuple(ids[j : j + BLOCK])))
        out.append(h)
    return out


class BlockIndex(Generic[T]):
    """Kept items, each under a token sequence and a key (whose items never serve another's)."""

    def __init__(self) -> None:
        # (key, chain hash of a start) -> (tokens, item) that start so, the most recent last
        self._index: dict[tuple[Hashable, int], list[tuple[tuple[int, ...], T]]] = {}

    def add(
        self, key: Hashable, tokens: tuple[int, ...], item: T
    ) -> list[tuple[tuple[int, ...], T]]:
        """List `item` under each whole block of `tokens`; returns the items (with their
        tokens) already listed whose tokens are a shorter start of `tokens` (an item n tokens
        long is listed under each of its whole blocks, the last at n // BLOCK)."""
        starts = []
        for depth, h in enumerate(block_hashes(tokens, len(tokens)), start=1):
            listed = self._index.setdefault((key, h), [])
            for t, other in listed:
                if len(t) // BLOCK == depth and len(t) < len(tokens) and tokens[: len(t)] == t:
                    starts.append((t, other))
            listed.append((tokens, item))
        return starts

    def remove(self, key: Hashable, tokens: tuple[int, ...], item: T) -> None:
        for h in block_hashes(tokens, len(tokens)):
            found = self._index.get((key, h))
            if found is None:
                continue
            found[:] = [x for x in found if x[1] is not item]
            if not found:
                del self._index[(key, h)]

    def clear(self) -> None:
        self._index.clear()

    def find(
        self,
        key: Hashable,
        ids: Sequence[int],
        limit: int,
        accept: Callable[[T], bool] | None = None,
        whole: bool = False,
    ) -> tuple[tuple[int, ...], T, int] | None:
        """(tokens, item, n): the item (of those `accept` takes) sharing the longest start with
        ids[:limit], n tokens long (at least MIN_TOKENS), the most recent among equals; None if
        there is none. `whole`: only items all of whose tokens ids[:limit] starts with (a
        recurrent state is kept at its sequence's end only)."""
        hits: list[list[tuple[tuple[int, ...], T]]] = []  # the items sharing each block
        for h in block_hashes(ids, limit):
            hit = self._index.get((key, h))
            if not hit:
                break
            hits.append(hit)
        # From the deepest block that hit: its items share n tokens, then token by token (within
        # one block: the next block missed for them all), the longest winning, the most recent of
        # the latest CANDIDATES first. A block with no item `accept` takes gives way to the one
        # before it.
        for depth in range(len(hits), 0, -1):
            n = depth * BLOCK
            best: tuple[tuple[int, ...], T] | None = None
            most = n
            for tokens, item in reversed(hits[depth - 1][-CANDIDATES:]):
                if accept is not None and not accept(item):
                    continue
                m, end = n, min(len(tokens), limit)
                while m < end and tokens[m] == ids[m]:
                    m += 1
                if whole and m < len(tokens):
                    continue
                if best is None or m > most:
                    best, most = (tokens, item), m
            if best is None:
                continue
            if best[0][:n] != tuple(ids[:n]) or most < MIN_TOKENS:  # a hash collision, or short
                return None
            return best[0], best[1], most
        return None
