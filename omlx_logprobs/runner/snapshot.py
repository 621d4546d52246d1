"""A kept sequence (a `Prefix`) taken out of mlx-lm's caches and put back into them: which models'
caches can be kept, a one-row cache seeded from a kept sequence, a batch row's or a one-row
cache's layers copied out, and a shared start made by a forward of its own.

Attention layers keep every token's keys and values, so any start of a kept sequence is a
prefix too. A recurrent layer (mlx-lm's `ArraysCache`: a conv window and a state, the linear
layers of Qwen3.5 / Qwen3-Next, LFM2, Granite 4, Nemotron-H, Falcon-H1, Mamba 2) keeps one
state, valid after exactly the tokens fed: a sequence of such a model is kept whole, its
states at its end, and only a prompt that starts with all of it resumes from it
(`Prefix.states`). Copies everywhere: `KVCache` writes into its buffers in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from omlx_logprobs.runner.batch_cache import leaves
from omlx_logprobs.runner.prefix import Prefix, State

__all__ = [
    "keeps_prefixes",
    "keeps_sequences",
    "keeps_states",
    "seed",
    "from_row",
    "from_cache",
    "make_prefix",
    "states_of",
    "states_nbytes",
    "kv_bytes_per_token",
    "Resumed",
    "resume_rows",
]


def keeps_prefixes(caches: list[Any]) -> bool:
    """Whether a model with these caches (`make_prompt_cache`'s) can start from any start of a
    kept sequence: plain KV and sliding-window layers, whose keys a prefix keeps for every one
    of its tokens (a sliding window's rows are seeded as if their whole left-padded prompt had
    been prefilled at once, see BatchCache.seeded)."""
    return all(type(c) is KVCache or (type(c) is RotatingKVCache and c.keep == 0) for c in caches)


def keeps_sequences(caches: list[Any]) -> bool:
    """Whether a finished sequence's keys and values can be kept: plain KV layers only (a
    sliding window has dropped its oldest tokens' keys by then)."""
    return all(type(c) is KVCache for c in caches)


def keeps_states(caches: list[Any]) -> bool:
    """Whether the model's sequences can be kept whole with their recurrent states: plain KV
    and `ArraysCache` layers (CacheLists of them too), at least one of them a state (mlx-lm's
    sliding window beside a state, recurrent_gemma's, is left out: its zero state is not a
    cold one)."""
    kinds = {type(c) for c in leaves(caches)}
    return ArraysCache in kinds and kinds <= {ArraysCache, KVCache}


def seed(cache: list[Any], prefix: Prefix) -> None:
    """Fill a one-row cache (`make_prompt_cache`'s) with a prefix's keys, values and states."""
    n = len(prefix.tokens)
    kv = iter(zip(prefix.keys, prefix.values))
    states = iter(prefix.states or ())
    for c in leaves(cache):
        if _is_state(c):
            # Layers rebind their slots, never write into them: the kept arrays stay as kept.
            c.cache = list(next(states))
            continue
        k, v = next(kv)
        if type(c) is RotatingKVCache:
            c.state = (k, v, n, c.keep, c.max_size, n)
        else:
            c.state = (k, v, n)


def from_row(
    prompt: Sequence[int], output: Any, n: int, layers: list[Any], row: int, pad: int
) -> Prefix:
    """A batch row's first n tokens (its prompt, then its output), their keys and values copied
    out of the batch's plain KV layers, and its recurrent states (lazy). A state is the row's
    after every token fed: where there is one, n must be that count (`ModelRunner.fed`)."""
    tokens = (*prompt, *output.tolist())[:n]
    end = pad + n
    keys, values, states = [], [], []
    for c in leaves(layers):
        if _is_state(c):
            states.append(tuple(mx.contiguous(s[row : row + 1]) for s in c.cache))
        elif _is_batch_kv(c):
            keys.append(mx.contiguous(c.keys[row : row + 1, :, pad:end, :]))
            values.append(mx.contiguous(c.values[row : row + 1, :, pad:end, :]))
    return Prefix(tokens, keys, values, states=tuple(states) if states else None)


def from_cache(tokens: Sequence[int], cache: list[Any]) -> Prefix:
    """A one-row cache's (`make_prompt_cache`'s) keys and values of `tokens`, copied (lazy):
    its buffers are allocated in steps of 256 tokens; its states, where it has them, after
    exactly these tokens."""
    n = len(tokens)
    keys, values, states = [], [], []
    for c in leaves(cache):
        if _is_state(c):
            states.append(tuple(mx.contiguous(s) for s in c.cache))
        else:
            keys.append(mx.contiguous(c.keys[..., :n, :]))
            values.append(mx.contiguous(c.values[..., :n, :]))
    return Prefix(tuple(tokens), keys, values, states=tuple(states) if states else None)


@dataclass
class Resumed:
    """Rows resumed from kept states in one forward, right-padded as mlx-lm's own batched prefill
    pads them: each layer prepared with the rows' lengths (a recurrent layer keeps each row's
    state at its last token; attention's pads follow a row's tokens, where its queries never
    look), then `finish` turns the right padding into left padding (BatchKVCache.finalize)."""

    layers: list[Any]  # per layer, the rows' caches merged by the layer's own class
    ids: mx.array  # [B, W] each row's new tokens, right-padded
    last: mx.array  # [B] each row's last new position
    pads: list[int]  # each row's left padding after `finish`
    fed: list[int]  # the tokens each row's caches hold after the forward

    def finish(self) -> None:
        for c in self.layers:
            c.finalize()


def resume_rows(
    model: Any, templates: list[Any], starts: list[Prefix], news: list[list[int]]
) -> Resumed:
    """A batch of rows, row i seeded from starts[i] (kept whole with its states), to be fed
    news[i] in one forward (`Resumed`); only for models whose recurrent layers take each row's
    length (`probe.resumes_in_a_batch`)."""
    rows = []
    for p in starts:
        cache = make_prompt_cache(model)
        seed(cache, p)
        rows.append(cache)
    layers = [type(t).merge([r[i] for r in rows]) for i, t in enumerate(templates)]
    held, lens = [len(p.tokens) for p in starts], [len(n) for n in news]
    right = [max(lens) - n for n in lens]
    for c in layers:
        c.prepare(lengths=lens, right_padding=right)
    ids = mx.array([n + [0] * r for n, r in zip(news, right)])
    pads = [max(held) - h + r for h, r in zip(held, right)]
    return Resumed(layers, ids, mx.array(lens) - 1, pads, [h + n for h, n in zip(held, lens)])


def states_of(cache: list[Any]) -> State:
    """A one-row cache's recurrent states, copied (lazy)."""
    return tuple(tuple(mx.contiguous(a) for a in c.cache) for c in leaves(cache) if _is_state(c))


def states_nbytes(cache: list[Any]) -> int:
    """What a one-row cache's recurrent states take."""
    return sum(a.nbytes for c in leaves(cache) if _is_state(c) for a in c.cache)


def kv_bytes_per_token(cache: list[Any]) -> int:
    """What a token's keys and values take in a one-row cache's plain KV layers (0: none)."""
    kv: list[Any] = [c for c in leaves(cache) if type(c) is KVCache and c.keys is not None]
    return sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in kv)


def make_prefix(model: Any, tokens: tuple[int, ...], base: Prefix | None) -> Prefix:
    """`tokens`' keys, values and states (lazy): a one-row forward, from `base`'s when given."""
    cache = make_prompt_cache(model)
    done = 0
    if base is not None:
        done = len(base.tokens)
        seed(cache, base)
    model(mx.array([tokens[done:]]), cache=cache)  # lazy: the head is never evaluated
    keys, values, states = [], [], []
    attention = (c for c in leaves(cache) if not _is_state(c))
    for i, c in enumerate(attention):
        k, v = c.keys_and_values()
        if type(c) is RotatingKVCache and base is not None:
            # The window dropped the base's older keys: the new tokens' keys follow the base's.
            new = len(tokens) - done
            k = mx.concatenate([base.keys[i], k[..., -new:, :]], axis=2)
            v = mx.concatenate([base.values[i], v[..., -new:, :]], axis=2)
        # Copies: the cache's buffers are allocated in steps of 256 tokens.
        keys.append(mx.contiguous(k))
        values.append(mx.contiguous(v))
    for c in leaves(cache):
        if _is_state(c):
            states.append(tuple(c.cache))
    return Prefix(tokens, keys, values, states=tuple(states) if states else None)


# Predicates, not `type(c) is ...` in place: mlx-lm's annotations would narrow `c` to classes
# whose arrays they type as None.
def _is_state(c: Any) -> bool:
    return type(c) is ArraysCache


def _is_batch_kv(c: Any) -> bool:
    return type(c) is BatchKVCache
