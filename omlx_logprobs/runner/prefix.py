"""A kept token sequence's keys and values (and a recurrent model's states after it): what the
prefix cache (runner/prefix_cache.py) and its disk tier (runner/disk_tier.py) hold, and what a
prompt's prefill is seeded from (runner/snapshot.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from omlx_logprobs.runner.prompt_scoring import KeptEntries

__all__ = ["BASE_KEY", "Key", "Prefix", "State", "on_base"]


@dataclass(frozen=True)
class Prefix:
    tokens: tuple[int, ...]
    # One [1, kv_heads, len(tokens), head_dim] array per layer: every token's, sliding-window
    # layers' included.
    keys: list[mx.array]
    values: list[mx.array]
    # Prompt entries of its first positions, where a scored prompt made it (prompt_scoring.py);
    # what a scored prompt may start from. Never on disk: the disk tier keeps keys and values.
    scores: KeptEntries | None = None
    # A recurrent model's (runner/snapshot.py): each state layer's arrays after exactly these
    # tokens, so that only the whole sequence is a start; None for attention models.
    states: tuple[tuple[mx.array, ...], ...] | None = None
    # A state kept at a chunk boundary of a longer kept sequence, whose keys and values these
    # are views of (`PrefixCache.keep_boundaries`): counted and gone with that one.
    within: tuple[int, ...] | None = None

    @property
    def array_nbytes(self) -> int:
        """Its keys, values and states: what a copy of it holds."""
        kv = sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))
        return kv + sum(a.nbytes for state in self.states or () for a in state)

    @property
    def nbytes(self) -> int:
        """Keys and values, and the prompt entries it holds (counted at their full length: a
        store still filling grows to the prompt's): what the byte budget counts."""
        if self.within is not None:
            return sum(a.nbytes for state in self.states or () for a in state)
        if self.scores is None:
            return self.array_nbytes
        return self.array_nbytes + len(self.tokens) * (12 + 8 * self.scores.store.k)

    def kv_start(self, n: int) -> Prefix:
        """Its first n tokens' keys and values (views), without its states."""
        keys = [k[..., :n, :] for k in self.keys]
        return Prefix(self.tokens[:n], keys, [v[..., :n, :] for v in self.values])

    def start(self, n: int) -> Prefix:
        """Its first n tokens' keys and values (views); a sequence with states only whole."""
        if n == len(self.tokens):
            return self
        if self.states is not None:
            raise ValueError("a recurrent state is kept at its sequence's end only")
        return Prefix(
            self.tokens[:n],
            [k[..., :n, :] for k in self.keys],
            [v[..., :n, :] for v in self.values],
            self.scores,
        )


# Whose keys and values a prefix holds: the base model's or a LoRA adapter's (slot, load), and
# in which namespace (a hash of vLLM's `cache_salt`, types.cache_namespace; 0: the default). A
# prefix is never shared across keys: an adapter changes every layer's keys and values, and
# requests of different salts must not learn from each other's cached prompts (nor time them).
Key = tuple[int, int, int]
# A recurrent model's states after some tokens: each state layer's arrays.
State = tuple[tuple[mx.array, ...], ...]
BASE_KEY: Key = (0, 0, 0)


def on_base(key: Key) -> bool:
    """Whether a key's prefixes are the base model's (those the disk tier keeps), whatever
    their namespace."""
    return key[:2] == BASE_KEY[:2]
