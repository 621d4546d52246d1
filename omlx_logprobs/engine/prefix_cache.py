"""Prompt prefixes whose keys and values stay on the device, so that prompts sharing one (a chat
template's system turn, one prompt sent many times) prefill only what follows it.

A prefix is kept only once two prompts have shared it (neighbours among the prompts of one
step, or the last prompt seen and the next), and its length is a multiple of BLOCK, so prompts
that share nothing beyond the template never fill the cache with prefixes no one will ask for
again. Least recently used prefixes go first when the byte budget is spent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

BLOCK = 8  # prefix lengths are multiples of this
MIN_TOKENS = 16  # shorter shared prefixes are not worth a forward of their own


@dataclass(frozen=True)
class Prefix:
    tokens: tuple[int, ...]
    keys: list[mx.array]  # one [1, kv_heads, len(tokens), head_dim] array per layer
    values: list[mx.array]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


# Makes the prefix `tokens` (a forward of the model), from a shorter kept one when there is one.
Make = Callable[[tuple[int, ...], "Prefix | None"], "Prefix"]


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of a's and b's common prefix."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self._lengths: dict[int, int] = {}  # entries per prefix length
        self._last: Sequence[int] = ()  # the last prompt assigned

    def assign(self, prompts: list[Sequence[int]], make: Make) -> list[Prefix | None]:
        """The longest kept prefix each prompt starts with, after making those that two
        neighbouring prompts (in this order, the first after the last prompt seen) share beyond
        the longest kept one. Every prompt keeps at least its last token to compute: the prefill
        needs its logits."""
        before = self._last
        for p in prompts:
            seen = min(len(p) - 1, shared_len(p, before))
            want = seen - seen % BLOCK
            before = p
            if want < MIN_TOKENS:
                continue
            have = self._longest(p, want)
            if have is None or len(have.tokens) < want:
                self._add(make(tuple(p[:want]), have))
        if prompts:
            self._last = prompts[-1]
        return [self._longest(p, len(p) - 1) for p in prompts]

    def held(self, ids: Sequence[int]) -> int:
        """The length of the longest kept prefix `ids` could start from (a look, not a use)."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(ids) and tuple(ids[:n]) in self.entries:
                return n
        return 0

    def _longest(self, ids: Sequence[int], limit: int) -> Prefix | None:
        # One lookup per kept length, longest first: lengths are few (multiples of BLOCK).
        for n in sorted(self._lengths, reverse=True):
            if n <= limit and (entry := self.entries.get(tuple(ids[:n]))) is not None:
                self.entries.move_to_end(entry.tokens)
                return entry
        return None

    def _add(self, prefix: Prefix) -> None:
        if prefix.tokens in self.entries or prefix.nbytes > self.max_bytes:
            return
        self.entries[prefix.tokens] = prefix
        self._lengths[len(prefix.tokens)] = self._lengths.get(len(prefix.tokens), 0) + 1
        self.nbytes += prefix.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self._forget(old)

    def _forget(self, old: Prefix) -> None:
        self.nbytes -= old.nbytes
        n = len(old.tokens)
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]

    def clear(self) -> None:
        self.entries.clear()
        self._lengths.clear()
        self.nbytes = 0
