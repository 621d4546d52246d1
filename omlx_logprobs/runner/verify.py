"""A verify step's inputs (runner/speculation.py): the ids it feeds, and each of its positions'
mask state, penalty history, sampling key and grammar bits, with the drafts before that position
taken as sampled. A row's drafts are ids on the host, or a draft model's still on the device
(runner/draft_model.py), which only the ids take, unread; the host reads them with the verify's
result, unless the row's grammar, bad words or penalties need them first (`reads_drafts`)."""

from __future__ import annotations

from typing import Any, cast

import llguidance.numpy as lln
import mlx.core as mx
import numpy as np

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.runner.grammar import open_ended
from omlx_logprobs.runner.sampler import MaskState, step_key

__all__ = ["Drafts", "grammar_bits", "grammar_trim", "ids", "positions", "read", "reads_drafts"]

Drafts = list[int] | mx.array


def reads_drafts(s: Sequence) -> bool:
    """Whether launching this row's verify needs its drafts' values on the host: its grammar's
    (`grammar_trim`, `grammar_bits`), its bad words' and its penalties' (`positions`)."""
    return s.grammar is not None or bool(s.params.bad_words_ids) or s.params.penalizes


def ids(rows: list[Sequence], drafts: list[Drafts], width: int) -> mx.array:
    """The verify's ids, [rows, width + 1]: each row's last token and drafts, padded with its
    last token; drafts still on the device join without being read."""
    if all(isinstance(d, list) for d in drafts):
        return mx.array(
            [
                [s.output_ids[-1], *d, *[s.output_ids[-1]] * (width - len(d))]
                for s, d in zip(rows, drafts)
            ]
        )
    parts = []
    for s, d in zip(rows, drafts):
        last = int(s.output_ids[-1])
        ids = mx.array(d, dtype=mx.int32) if isinstance(d, list) else d
        pad = mx.full((width - len(d) + 1,), last, dtype=mx.int32)
        parts.append(mx.concatenate([pad[:1], ids, pad[1:]]))
    return mx.stack(parts)


def read(drafts: Drafts) -> list[int]:
    return drafts if isinstance(drafts, list) else cast(list[int], drafts.tolist())


def positions(
    rows: list[Sequence], drafts: list[list[int]], n: int
) -> tuple[list[MaskState], list[tuple[Any, Any]], list[mx.array | None]]:
    """Each flat position's mask state, penalty history and sampling key: the row's state with
    the drafts before that position taken as sampled."""
    states: list[MaskState] = []
    histories: list[tuple[Any, Any]] = []
    keys: list[mx.array | None] = []
    for s, d in zip(rows, drafts):
        p = s.params
        longest = max((len(w) for w in p.bad_words_ids), default=1)
        tail = s.output_ids[-longest:].tolist() if p.masks else []
        output = s.output_ids.tolist() if p.penalizes else []
        for j in range(n):
            ahead = d[: min(j, len(d))]
            states.append(MaskState(s.num_sampled + j, tail + ahead, False))
            histories.append((s.prompt_ids, output + ahead) if p.penalizes else ((), ()))
            keys.append(step_key(p.seed, s.num_sampled + j, s.choice_index))
    return states, histories, keys


def grammar_trim(rows: list[Sequence], drafts: list[list[int]]) -> None:
    """A constrained row's draft ends (in place) before the first token its grammar refuses
    there: the target could never sample it."""
    for s, d in zip(rows, drafts):
        m = s.grammar
        if m is not None and d:
            del d[0 if m.is_error() else m.validate_tokens(d) :]


def grammar_bits(
    rows: list[Sequence], drafts: list[list[int]], width: int, vocab: int
) -> np.ndarray | None:
    """Each flat position's allowed-token bitmask (runner/grammar.py's layout): a copy of a
    constrained row's matcher is advanced over its drafts (all valid: `grammar_trim`) to read
    each position's mask; the output processor advances the row's own by what is accepted.
    (Not consume-then-rollback: after a rollback inside a string with a maxLength, llguidance
    0.x allowed a token it then refused; tests/engine/test_speculation.py caught it.)"""
    if not any(s.grammar is not None for s in rows):
        return None
    n = width + 1
    bits = lln.allocate_token_bitmask(len(rows) * n, vocab)
    for i, (s, d) in enumerate(zip(rows, drafts)):
        m = s.grammar
        if m is None or m.is_error():
            continue
        if open_ended(s.params.constraint) and m.is_accepting():
            continue  # complete and open-ended: every token (its drafts are none)
        if d:
            m = m.deep_copy()
        for j in range(len(d) + 1):
            lln.fill_next_token_bitmask(m, bits, i * n + j)
            if j < len(d):
                m.consume_token(d[j])
    bits[~bits.any(axis=1)] = -1  # rows without a grammar, and padding: every token
    return bits
