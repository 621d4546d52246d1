"""An encoder embedding model's forward (BERT, XLM-R: bidirectional attention, no KV cache, no
head), through `mlx-embeddings`' model classes: a batch of token id lists right-padded, its
attention mask, and each row's pooled vector as sentence-transformers' Pooling module makes it
(mean over the row's tokens, or its first token: CLS). Normalizing and `dimensions` are the
API's (api/core/embedding.py), as for a causal model's last hidden state (runner/pooling.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.models.dtype import apply_dtype
from omlx_logprobs.models.embedding import POOLINGS

__all__ = ["EncoderRunner"]
log = logging.getLogger("omlx_logprobs")


class EncoderRunner:
    """One encoder model's weights, and its forward over a padded batch."""

    def __init__(self, path: Path, pooling: str, pad_id: int, dtype: str = "auto") -> None:
        from mlx_embeddings.utils import load_model

        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.model: Any = load_model(path)
        # --dtype as for a causal model (models/dtype.py): float32 on the CPU by default
        log.info("encoder weights: %s", apply_dtype(self.model, dtype))
        # Evaluated in this thread, the one that runs the forwards (a lazy array belongs to
        # the stream of the thread that made it).
        mx.eval(self.model.parameters())
        self.pooling, self.pad_id = pooling, pad_id

    def embed(self, rows: list[list[int]]) -> list[np.ndarray]:
        """Each row's pooled last hidden state, [H] float32, in order. The rows are padded on
        the right to the longest: a padded position is masked out of every attention and of
        the mean, and the first and each row's last real token stay where they are."""
        width = max(len(r) for r in rows)
        ids = mx.array([r + [self.pad_id] * (width - len(r)) for r in rows], dtype=mx.int32)
        mask = mx.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
        hidden = self.model(ids, attention_mask=mask).last_hidden_state.astype(mx.float32)
        if self.pooling == "cls":
            pooled = hidden[:, 0, :]
        elif self.pooling == "lasttoken":
            last = mx.array([len(r) - 1 for r in rows])
            pooled = hidden[mx.arange(len(rows)), last, :]
        else:
            weights = mask[..., None].astype(mx.float32)
            pooled = (hidden * weights).sum(axis=1) / weights.sum(axis=1)
        host = np.array(pooled)
        return [host[i].copy() for i in range(len(rows))]
