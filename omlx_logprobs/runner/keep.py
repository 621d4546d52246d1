"""Finished batch rows into the prefix cache (runner/prefix_cache.py), each under its tokens:
the prompt and the output but its last token (every other output token was fed back; whether
the last one was depends on step timing, and the same conversation should keep the same)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.runner.batch_state import BatchState
from omlx_logprobs.runner.prefix import Key
from omlx_logprobs.runner.prefix_cache import PrefixCache
from omlx_logprobs.runner.prompt_cache import PromptCache
from omlx_logprobs.runner.snapshot import from_row
from omlx_logprobs.types import FinishReason

__all__ = ["keep_finished"]


def keep_finished(
    batch: BatchState,
    rows: list[int],
    prefixes: PrefixCache,
    prompt_cache: PromptCache,
    key_of: Callable[[Sequence], Key],
    whole: bool,
) -> None:
    """Keep these rows of the batch's cache (a scored prompt's with its entries, a recurrent
    model's `whole`, with its states and those at its prompt's chunk boundaries); `key_of`: a
    sequence's key, its adapter's and its namespace (runner/prefix.py)."""
    cache = batch.cache
    if cache is None:
        return
    for i in rows:
        seq = batch.rows[i]
        if seq.finish_reason is FinishReason.ERROR:
            continue
        n = len(seq.prompt_ids) + seq.num_output - 1  # prompt_len is the last prefill's
        if whole:  # a state is the row's after every token fed: all of them
            n = min(cache.fed[i], n + 1)
        assert n <= cache.width - cache.pads[i] or not cache.width
        if n < prefixes.min_use and not seq.scored:  # too short to pay: no copy
            continue
        prefix = from_row(seq.prompt_ids, seq.output_ids, n, cache.layers, i, cache.pads[i])
        prefix = prompt_cache.finished(seq, prefix)  # a scored one's, with its entries
        # The copies now, with the step: until then they would hold the batch's arrays.
        mx.async_eval(prefix.keys, prefix.values)
        prefixes.keep(key_of(seq), prefix)
        if at := batch.boundaries.get(seq.seq_id):
            prefixes.keep_boundaries(key_of(seq), prefix, at)
