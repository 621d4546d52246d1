"""mlx-lm model modules made to run a left-padded batch, where their own code cannot.

mlx-lm's gemma2 attention computes its soft-capped scores itself, and with grouped queries
(more query heads than KV heads) it reshapes them to five axes, (batch, kv heads, repeats,
queries, keys). The batch caches' padding mask has four, (batch, 1, queries, keys), so
broadcasting aligns its batch axis with the KV heads: an error at most batch sizes, and
silently wrong logits where the batch size equals the number of KV heads. A lone sequence's
mask has two axes, which broadcast right, so mlx-lm's own generation never meets it. Here such
a mask gets the missing axis before the layer's own code runs; nothing else changes, so a
sequence alone computes exactly what mlx-lm's module computes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def _padded_gemma2_attention() -> type[nn.Module]:
    from mlx_lm.models.gemma2 import Attention

    class PaddedBatchAttention(Attention):  # type: ignore[misc,valid-type]
        def __call__(
            self, x: mx.array, mask: mx.array | None = None, cache: Any = None
        ) -> mx.array:
            if self.repeats > 1 and isinstance(mask, mx.array) and mask.ndim == 4:
                mask = mx.expand_dims(mask, 2)  # (batch, 1, 1, queries, keys)
            return super().__call__(x, mask, cache)

    return PaddedBatchAttention


# mlx-lm module -> (its attention class's name, the replacement's factory).
_FIXES = {"mlx_lm.models.gemma2": ("Attention", _padded_gemma2_attention)}


def fit_for_padded_batches(net: nn.Module) -> int:
    """Swap the class of each attention layer that needs it (the weights stay where they are);
    returns how many layers were changed."""
    fix = _FIXES.get(type(net).__module__)
    if fix is None:
        return 0
    name, factory = fix
    padded = factory()
    changed = 0
    for _, module in net.named_modules():
        if type(module).__name__ == name and type(module).__module__ == type(net).__module__:
            module.__class__ = padded
            changed += 1
    return changed
