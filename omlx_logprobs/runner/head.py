"""A model's forward as a body (hidden states) and a head (logits), where its module tree has
that split: prefill then runs the head on the positions it needs only (the last one, or the
scored ones block by block) instead of on every prompt position.

Families name their parts differently (`model`/`backbone`, `lm_head` or a tied embedding's
`as_linear` under `embed_tokens`/`wte`/`embeddings`) and some end with a transform (Gemma 2's
`final_logit_softcapping`, Granite's `logits_scaling`, Falcon-H1's multipliers). A split is
used only when a probe forward shows that body-then-head gives the model's own logits; any
other model takes the generic path, its own forward on every position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

Fn = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SplitForward:
    body: Callable[..., mx.array]  # (ids, cache=...) -> [B, L, H] hidden states
    head: Fn  # [..., H] -> [..., V] logits, as the model's own forward has them


def _bodies(model: Any) -> list[Any]:
    return [getattr(model, n) for n in ("model", "backbone", "transformer") if hasattr(model, n)]


def _heads(model: Any, body: Any) -> list[Fn]:
    out = []
    if hasattr(model, "lm_head"):
        out.append(model.lm_head)
    for name in ("embed_tokens", "wte", "embeddings"):
        emb = getattr(body, name, None)
        if emb is not None and hasattr(emb, "as_linear"):
            out.append(emb.as_linear)
    return out


def _posts(model: Any) -> list[Fn]:
    """The last transforms that families apply to the head's output (identity first)."""
    args = getattr(model, "args", None)
    out: list[Fn] = [lambda x: x]
    cap = getattr(args, "final_logit_softcapping", None)
    if cap:
        out.append(lambda x: mx.tanh(x / cap) * cap)
    scale = getattr(args, "logits_scaling", None)
    if scale:
        out.append(lambda x: x / scale)
    mult, emb = (getattr(args, n, None) for n in ("lm_head_multiplier", "embedding_multiplier"))
    if mult and emb:
        out.append(lambda x: x * (mult / emb))
    return out


def split_forward(
    model: Any, ids: mx.array, want: mx.array, make_cache: Callable[[], list[Any]]
) -> SplitForward | None:
    """The model's body and head: the first candidate whose logits on `ids` (with a fresh cache
    from `make_cache`) equal `want`, the model's own forward on them; None where none does.
    The candidates are the model's, then those of the language model a vision checkpoint's
    text module wraps (`language_model`: mlx-lm's mistral3, pixtral, gemma3...)."""
    owners = [model, *([model.language_model] if hasattr(model, "language_model") else [])]
    for owner in owners:
        for body in _bodies(owner):
            try:
                hidden = body(ids, cache=make_cache())
                mx.eval(hidden)
            except Exception:  # noqa: BLE001  (not a body after all: the next candidate)
                continue
            for head in _heads(owner, body):
                for post in _posts(owner):
                    got = post(head(hidden))
                    if got.shape == want.shape and mx.allclose(got, want, rtol=1e-5, atol=1e-5):
                        return SplitForward(body, _composed(head, post))
    return None


def _composed(
    head: Callable[[mx.array], mx.array], post: Callable[[mx.array], mx.array]
) -> Callable[[mx.array], mx.array]:
    return lambda h: post(head(h))
