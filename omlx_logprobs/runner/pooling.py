"""Embedding prompts' hidden states: the body's output (the final norm applied, the head not) at
each prompt's last position, what last-token pooling reads (Qwen3-Embedding). Queued with the
step and brought to the host when it is collected, as prompt entries are; normalizing and
truncating are the API's (api/embeddings/), so the engine hands out the model's own numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.batch.sequence import Sequence

__all__ = ["PendingPooled", "last_hidden"]


@dataclass(frozen=True)
class PendingPooled:
    """The last hidden states of prompts prefilled together, row i seqs[i]'s, still lazy."""

    seqs: list[Sequence]
    hidden: mx.array  # [B, H] float32

    def to_host(self) -> list[tuple[Sequence, np.ndarray]]:
        host = np.array(self.hidden, copy=False)
        return [(s, host[i].copy()) for i, s in enumerate(self.seqs)]


def last_hidden(body: Callable[..., mx.array] | None, ids: mx.array, cache: Any) -> mx.array:
    """[B, H] float32: the body's hidden state at the last column of `ids` (left-padded rows
    end together there). A model whose body and head were not found apart (runner/head.py's
    split: `body` None) has no hidden state to read: its embedding prompts fail alone, as a
    prefill that failed."""
    if body is None:
        raise RuntimeError("this model's hidden states cannot be read apart from its logits")
    return body(ids, cache=cache)[:, -1, :].astype(mx.float32)
