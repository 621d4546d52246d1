"""Prompt prefixes whose keys and values stay on the device, so that prompts sharing one (a chat
template's system turn, one prompt sent many times) prefill only what follows it.

A prefix is kept only once two prompts have shared it (a prompt and the last one seen that began
with the same MIN_TOKENS tokens), and its length is a multiple of BLOCK, so prompts that share
nothing beyond the template never fill the cache with prefixes no one will ask for again. Least
recently used prefixes go first when the byte budget is spent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

BLOCK = 8  # prefix lengths are multiples of this
MIN_TOKENS = 16  # shorter shared prefixes are not worth a forward of their own
RECENT = 256  # prompt starts remembered, each with the last prompt that began with it


@dataclass(frozen=True)
class Prefix:
    tokens: tuple[int, ...]
    # One [1, kv_heads, len(tokens), head_dim] array per layer: every token's, sliding-window
    # layers' included.
    keys: list[mx.array]
    values: list[mx.array]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


# Whose keys and values a prefix holds: the base model's or a LoRA adapter's (slot, load). A
# prefix is never shared across keys: an adapter changes every layer's keys and values.
Key = tuple[int, int]
BASE_KEY: Key = (0, 0)
# Makes the prefix `tokens` (a forward of the model), from a shorter kept one when there is one,
# for the rows of a key.
Make = Callable[[tuple[int, ...], "Prefix | None", Key], "Prefix"]


def keeps_prefixes(caches: list[Any]) -> bool:
    """Whether a model with these caches (`make_prompt_cache`'s) can start from a kept prefix:
    plain KV and sliding-window layers, whose keys a prefix keeps for every one of its tokens
    (a sliding window's rows are seeded as if their whole left-padded prompt had been prefilled
    at once, see BatchCache.seeded). A recurrent state holds no per-token record: it cannot be
    cut at each row's padding."""
    return all(type(c) is KVCache or (type(c) is RotatingKVCache and c.keep == 0) for c in caches)


def make_prefix(model: Any, tokens: tuple[int, ...], base: Prefix | None) -> Prefix:
    """`tokens`' keys and values (lazy): a one-row forward, from `base`'s when given."""
    cache = make_prompt_cache(model)
    done = 0
    if base is not None:
        done = len(base.tokens)
        for c, k, v in zip(cache, base.keys, base.values):
            if type(c) is RotatingKVCache:
                c.state = (k, v, done, c.keep, c.max_size, done)
            else:
                c.state = (k, v, done)
    model(mx.array([tokens[done:]]), cache=cache)  # lazy: the head is never evaluated
    keys, values = [], []
    for i, c in enumerate(cache):
        k, v = c.keys_and_values()
        if type(c) is RotatingKVCache and base is not None:
            # The window dropped the base's older keys: the new tokens' keys follow the base's.
            new = len(tokens) - done
            k = mx.concatenate([base.keys[i], k[..., -new:, :]], axis=2)
            v = mx.concatenate([base.values[i], v[..., -new:, :]], axis=2)
        # Copies: the cache's buffers are allocated in steps of 256 tokens.
        keys.append(mx.contiguous(k))
        values.append(mx.contiguous(v))
    return Prefix(tokens, keys, values)


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of a's and b's common prefix."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, max_bytes: int, make: Make) -> None:
        self.max_bytes = max_bytes
        self.make = make
        # (key, tokens) -> prefix, oldest use first
        self.entries: OrderedDict[tuple[Key, tuple[int, ...]], Prefix] = OrderedDict()
        self.nbytes = 0
        self._lengths: dict[int, int] = {}  # entries per prefix length
        # (key, first MIN_TOKENS tokens) -> the last prompt assigned that began with them.
        self._recent: OrderedDict[tuple[Key, tuple[int, ...]], Sequence[int]] = OrderedDict()

    def assign(
        self, prompts: list[Sequence[int]], keys: list[Key] | None = None
    ) -> list[Prefix | None]:
        """The longest kept prefix each prompt starts with, after making those that a prompt
        shares, beyond the longest kept one, with the last prompt (of this step or an earlier
        one) that began the same way, on the same key. Every prompt keeps at least its last token
        to compute: the prefill needs its logits. `keys`: each prompt's key (default: the base)."""
        keys = keys or [BASE_KEY] * len(prompts)
        for p, key in zip(prompts, keys):
            if len(p) <= MIN_TOKENS:
                continue
            head = (key, tuple(p[:MIN_TOKENS]))
            before = self._recent.pop(head, None)
            self._recent[head] = p
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            if before is None:
                continue
            seen = min(len(p) - 1, shared_len(p, before))
            want = seen - seen % BLOCK
            have = self._longest(p, want, key)
            if have is None or len(have.tokens) < want:
                self._add(key, self.make(tuple(p[:want]), have, key))
        return [self._longest(p, len(p) - 1, key) for p, key in zip(prompts, keys)]

    def clear(self) -> None:
        """Forget every kept prefix (their keys and values belong to weights now replaced)."""
        self.entries.clear()
        self._lengths.clear()
        self._recent.clear()
        self.nbytes = 0

    def drop(self, key: Key) -> None:
        """Forget one key's prefixes (its adapter is unloaded)."""
        for k in [k for k in self.entries if k[0] == key]:
            self._forget(self.entries.pop(k))
        for k in [k for k in self._recent if k[0] == key]:
            del self._recent[k]

    def held(self, ids: Sequence[int], key: Key = BASE_KEY) -> int:
        """The length of the longest kept prefix `ids` could start from (a look, not a use)."""
        found = self._find(ids, len(ids) - 1, key)
        return len(found.tokens) if found is not None else 0

    def _longest(self, ids: Sequence[int], limit: int, key: Key) -> Prefix | None:
        found = self._find(ids, limit, key)
        if found is not None:
            self.entries.move_to_end((key, found.tokens))
        return found

    def _find(self, ids: Sequence[int], limit: int, key: Key) -> Prefix | None:
        # One lookup per kept length, longest first: lengths are few (multiples of BLOCK).
        for n in sorted(self._lengths, reverse=True):
            if n <= limit and (entry := self.entries.get((key, tuple(ids[:n])))) is not None:
                return entry
        return None

    def _add(self, key: Key, prefix: Prefix) -> None:
        if (key, prefix.tokens) in self.entries or prefix.nbytes > self.max_bytes:
            return
        self.entries[(key, prefix.tokens)] = prefix
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
