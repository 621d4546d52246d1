"""A plain step's token masks (runner/sampler.py's `token_mask`), each row's read where it
stands: a row whose last sampled token was not processed yet reads it from the last step's ids,
on the device (the batch state's `last_tokens`, runner/batch_state.py)."""

from __future__ import annotations

import mlx.core as mx

from omlx_logprobs.batch.budget import forced_token
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.runner.batch_state import BatchState
from omlx_logprobs.runner.grammar import bitmask, open_ended
from omlx_logprobs.runner.sampler import MaskState, token_mask

__all__ = ["masked"]


def masked(
    logits: mx.array,
    seqs: list[Sequence],
    batch: BatchState,
    vocab_size: int,
    stop_ids: tuple[int, ...],
) -> mx.array:
    """The rows' logits with their token masks (the logits themselves where no row masks);
    `stop_ids`: EOS ids, what min_tokens holds back besides stop_token_ids."""
    if not any(s.params.masks for s in seqs):
        return logits
    states, prev_rows = [], []
    for s in seqs:
        # On a GPU the step in flight may be processed (its token appended) meanwhile:
        # one read of the length, and only the tail the bad words need, before it.
        n = len(s.output_ids)
        longest = max((len(w) for w in s.params.bad_words_ids), default=1)
        tail = s.output_ids[max(n - longest, 0) : n].tolist()
        in_flight = s.num_sampled > n and s.seq_id in batch.last_rows
        # A row in flight is never forced at this step: else the engine processed it first
        # (batch/budget.py's `budget_due`).
        forced = None if in_flight else forced_token(s, s.num_sampled)
        states.append(MaskState(s.num_sampled, tail, in_flight, forced))
        prev_rows.append(batch.last_rows[s.seq_id] if in_flight else 0)
    prev = None
    if batch.last_tokens is not None and any(st.in_flight for st in states):
        prev = batch.last_tokens[mx.array(prev_rows)]
    # Constrained rows were processed before this launch (Engine._needs_history).
    assert not any(s.grammar is not None and st.in_flight for s, st in zip(seqs, states))
    bits = bitmask(
        [s.grammar for s in seqs],
        vocab_size,
        [open_ended(s.params.constraint) for s in seqs],
    )
    return token_mask(logits, [s.params for s in seqs], states, stop_ids, prev, bits)
