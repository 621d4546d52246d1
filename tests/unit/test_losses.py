"""The losses of training/losses.py against a hand computation in float64: the terms per
position and their gradient with respect to the trained logprobs (GSPO-token's stop-gradients
make its gradient the sequence ratio times the advantage where the ratio is not clipped away,
not the derivative of the terms' values)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.training import losses

LP = np.array([-2.0, -1.5, -0.25, -3.0, -0.75, -1.25], np.float32)  # the trainer's logprobs
SAMPLED = np.array([0.0, 0.0, -0.5, -3.125, -0.5, -1.5], np.float32)  # the sampler's
ADV = np.array([0.0, 0.0, 1.5, -0.5, 2.0, -1.0], np.float32)
MASK = np.array([0, 0, 1, 1, 1, 1], np.float32)  # the sampled tokens


def inputs(mask: np.ndarray = MASK) -> dict[str, mx.array]:
    return {"logprobs": mx.array(SAMPLED), "advantages": mx.array(ADV),
            "sequence_ratio_mask": mx.array(mask)}  # fmt: skip


def terms_and_grad(config: dict[str, float], mask: np.ndarray = MASK) -> tuple[np.ndarray, ...]:
    x = inputs(mask)
    terms = losses.gspo(mx.array(LP), x, config)
    grad = mx.grad(lambda lp: losses.gspo(lp, x, config).sum())(mx.array(LP))
    return np.array(terms, np.float64), np.array(grad, np.float64)


def test_gspo_by_hand() -> None:
    # the mean log-ratio over the sampled tokens: (0.25 + 0.125 - 0.25 + 0.25) / 4 = 0.09375
    s = np.exp(0.09375)  # 1.0983, inside the default bounds (0.8, 1.2)
    terms, grad = terms_and_grad({})
    np.testing.assert_allclose(terms, -s * ADV.astype(np.float64), rtol=1e-6, atol=1e-7)
    # every position's ratio is s, with the gradient of its own logprob: d term / d lp = -s * adv
    np.testing.assert_allclose(grad, -s * ADV.astype(np.float64), rtol=1e-6, atol=1e-7)


def test_gspo_clips_the_sequence_ratio() -> None:
    s = np.exp(0.09375)
    terms, grad = terms_and_grad({"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})
    adv = ADV.astype(np.float64)
    # s > 1.05: a positive advantage takes the clipped term (no gradient), a negative the
    # unclipped one, min(s * adv, 1.05 * adv)
    np.testing.assert_allclose(terms, -np.minimum(s * adv, 1.05 * adv), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, np.where(adv > 0, 0.0, -s * adv), rtol=1e-6, atol=1e-7)


def test_gspo_ratio_is_the_sequences_not_the_tokens() -> None:
    """Only the marked positions make the ratio: marking the first sampled token alone gives
    exp(0.25) at every position."""
    terms, _ = terms_and_grad({"clip_high_threshold": 2.0}, np.array([0, 0, 1, 0, 0, 0]))
    np.testing.assert_allclose(terms, -np.exp(0.25) * ADV, rtol=1e-6, atol=1e-7)
    # a mask that marks nothing: a ratio of 1, REINFORCE's terms
    terms, grad = terms_and_grad({}, np.zeros(6, np.float32))
    np.testing.assert_allclose(terms, -ADV, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, -ADV, rtol=1e-6, atol=1e-7)


def test_gspo_reads_the_mask() -> None:
    assert losses.needs("gspo") == ("target_tokens", "logprobs", "advantages",
                                    "sequence_ratio_mask")  # fmt: skip
    with pytest.raises(losses.LossError, match="not available"):
        losses.needs("stable_reinforce")
