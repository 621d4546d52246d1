"""Which kept token sequence shares the longest start with a prompt: the prefix cache's index,
in memory and on disk alike.

Each kept sequence's starts are hashed at every multiple of BLOCK (a chain of block hashes, as
vLLM's automatic prefix caching keys its blocks); a lookup walks the prompt's blocks until one
misses, then compares tokens one by one past the last hit. Plain Python: no model, no mlx.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

BLOCK = 8  # the index's granularity
MIN_TOKENS = 16  # shorter shared starts are not worth keeping or looking up

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

    def add(self, key: Hashable, tokens: tuple[int, ...], item: T) -> None:
        for h in block_hashes(tokens, len(tokens)):
            self._index.setdefault((key, h), []).append((tokens, item))

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
        self, key: Hashable, ids: Sequence[int], limit: int
    ) -> tuple[tuple[int, ...], T, int] | None:
        """(tokens, item, n): the most recent item sharing the longest start with ids[:limit],
        n tokens long (at least MIN_TOKENS); None if there is none."""
        best: tuple[tuple[int, ...], T] | None = None
        n = 0
        for j, h in enumerate(block_hashes(ids, limit)):
            found = self._index.get((key, h))
            if not found:
                break
            best, n = found[-1], (j + 1) * BLOCK
        if best is None or best[0][:n] != tuple(ids[:n]):  # none, or a hash collision
            return None
        tokens = best[0]
        # Past the last whole block: token by token, within the sequence and the limit.
        end = min(len(tokens), limit)
        while n < end and tokens[n] == ids[n]:
            n += 1
        return (tokens, best[1], n) if n >= MIN_TOKENS else None
