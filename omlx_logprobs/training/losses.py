"""Tinker's built-in losses, each a sum over a datum's positions of a term per position, from
the target tokens' logprobs under the weights being trained (`lp`, [N]) and the datum's
`loss_fn_inputs` (each [N]); `config` is the request's `loss_fn_config`. Every loss's
`target_tokens` picks `lp` (training/trainer.py); the terms are returned so that a forward
reports them (`elementwise_loss`).

- cross_entropy: -weights * lp
- importance_sampling: -ratio * advantages, ratio = exp(lp - logprobs) (the sampler's logprobs)
- ppo: -min(ratio * adv, clip(ratio, clip_low_threshold, clip_high_threshold) * adv)
- cispo: -stop_gradient(clip(ratio, low, high)) * lp * adv
- dro: -(lp * adv - beta / 2 * (lp - logprobs) ** 2), `beta` from the config
- gspo (GSPO-token): ppo's term with every position's ratio the sequence's, s =
  exp(mean(lp - logprobs) over the positions `sequence_ratio_mask` marks), carrying the
  gradient of the position's own lp: s_t = stop_gradient(s) * exp(lp - stop_gradient(lp))
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

CLIP = (0.8, 1.2)  # the ratio's default bounds for ppo, cispo and gspo


class LossError(ValueError):
    """The loss cannot be computed for this request (the message says why)."""


Inputs = dict[str, mx.array]
Config = dict[str, float]


def _ratio(lp: mx.array, x: Inputs) -> mx.array:
    return mx.exp(lp - x["logprobs"])


def _bounds(config: Config) -> tuple[float, float]:
    return (
        float(config.get("clip_low_threshold", CLIP[0])),
        float(config.get("clip_high_threshold", CLIP[1])),
    )


def cross_entropy(lp: mx.array, x: Inputs, config: Config) -> mx.array:
    return -x["weights"] * lp


def importance_sampling(lp: mx.array, x: Inputs, config: Config) -> mx.array:
    return -_ratio(lp, x) * x["advantages"]


def ppo(lp: mx.array, x: Inputs, config: Config) -> mx.array:
    ratio, adv = _ratio(lp, x), x["advantages"]
    low, high = _bounds(config)
    return -mx.minimum(ratio * adv, mx.clip(ratio, low, high) * adv)


def cispo(lp: mx.array, x: Inputs, config: Config) -> mx.array:
    low, high = _bounds(config)
    weight = mx.stop_gradient(mx.clip(_ratio(lp, x), low, high))
    return -weight * lp * x["advantages"]


def dro(lp: mx.array, x: Inputs, config: Config) -> mx.array:
    if "beta" not in config:
        raise LossError("the dro loss needs `beta` in loss_fn_config")
    beta = float(config["beta"])
    return -(lp * x["advantages"] - beta / 2 * (lp - x["logprobs"]) ** 2)


def gspo(lp: mx.array, x: Inputs, config: Config) -> mx.array:
    low, high = _bounds(config)
    marked = x["sequence_ratio_mask"] != 0
    # a mask that marks nothing: the mean over no positions taken as 0, a ratio of 1
    count = mx.maximum(marked.sum(), 1)
    log_ratio = mx.where(marked, mx.stop_gradient(lp) - x["logprobs"], 0.0).sum() / count
    ratio = mx.exp(log_ratio + lp - mx.stop_gradient(lp))
    adv = x["advantages"]
    return -mx.minimum(ratio * adv, mx.clip(ratio, low, high) * adv)


Loss = Callable[[mx.array, Inputs, Config], mx.array]

# Each loss and the loss_fn_inputs it reads besides target_tokens.
LOSSES: dict[str, tuple[Loss, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
    "ppo": (ppo, ("logprobs", "advantages")),
    "cispo": (cispo, ("logprobs", "advantages")),
    "dro": (dro, ("logprobs", "advantages")),
    "gspo": (gspo, ("logprobs", "advantages", "sequence_ratio_mask")),
}


def needs(name: str) -> tuple[str, ...]:
    """The loss_fn_inputs a loss reads, target_tokens first; LossError for one not built in."""
    if name not in LOSSES:
        raise LossError(
            f"the loss {name!r} is not available: the built-in losses here are {', '.join(LOSSES)}"
        )
    return ("target_tokens", *LOSSES[name][1])
