"""runner/fast/fusion.py: sibling projections joined into one matmul give every family the forward
it had, keep the model's parameter names, follow replaced weights after `rejoin`, and leave
alone layers that cannot join."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from omlx_logprobs.runner.fast.fusion import Fusion
from tests.helpers.families import FAMILIES, _model_class

IDS = mx.array([[5, 17, 301, 4000, 12, 9, 77, 1024]])


def _model(model_type: str, seed: int = 3) -> Any:
    mx.random.seed(seed)
    model_cls, args_cls = _model_class(model_type)
    model = model_cls(args_cls.from_dict({"model_type": model_type, **FAMILIES[model_type]}))
    mx.eval(model.parameters())
    return model


def _logits(model: Any) -> np.ndarray:
    return np.array(model(IDS).astype(mx.float32))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_keeps_its_forward(model_type: str) -> None:
    model = _model(model_type)
    before = _logits(model)
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    fusion = Fusion(model)
    np.testing.assert_allclose(_logits(model), before, rtol=0, atol=1e-5)
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names
    if model_type == "llama":  # q/k/v and gate/up in each of its layers
        assert len(fusion) == 2 * len(model.layers)


def test_members_share_the_joined_buffer() -> None:
    model = _model("llama")
    Fusion(model)
    attn = model.layers[0].self_attn
    q, k = np.array(attn.q_proj.weight, copy=False), np.array(attn.k_proj.weight, copy=False)
    # k's rows follow q's in one allocation: views, not copies
    assert k.ctypes.data == q.ctypes.data + q.nbytes


def test_a_second_engine_on_the_model_finds_its_groups() -> None:
    """A model object served again (another engine, a restarted one) keeps its joined groups:
    the second Fusion holds the same ones, so the lean step still serves it."""
    model = _model("llama")
    first = Fusion(model)
    before = _logits(model)
    second = Fusion(model)
    assert len(second) == len(first) == 2 * len(model.layers)
    assert all(a is b for a, b in zip(first.groups, second.groups))
    np.testing.assert_allclose(_logits(model), before, rtol=0, atol=0)


def test_rejoin_follows_replaced_weights() -> None:
    model, fresh = _model("llama", seed=3), _model("llama", seed=4)
    fusion = Fusion(model)
    model.load_weights(list(tree_flatten(fresh.parameters())), strict=True)
    stale = _logits(model)  # the joined arrays still hold the old weights
    fusion.rejoin()
    expected = _logits(fresh)
    assert np.abs(stale - expected).max() > 1e-3
    np.testing.assert_allclose(_logits(model), expected, rtol=0, atol=1e-5)


def test_quantized_layers_join() -> None:
    model = _model("llama")
    nn.quantize(model, group_size=32, bits=4)
    before = _logits(model)
    assert len(Fusion(model)) == 2 * len(model.layers)
    np.testing.assert_allclose(_logits(model), before, rtol=0, atol=1e-5)


def test_another_input_gets_its_own_product() -> None:
    model = _model("llama")
    attn = model.layers[0].self_attn
    width = attn.q_proj.weight.shape[1]
    x1, x2 = mx.random.normal((1, 3, width)), mx.random.normal((1, 3, width))
    expected = [np.array(attn.q_proj(x1)), np.array(attn.k_proj(x2)), np.array(attn.v_proj(x1))]
    Fusion(model)
    got = [np.array(attn.q_proj(x1)), np.array(attn.k_proj(x2)), np.array(attn.v_proj(x1))]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5)


def test_layers_that_differ_stay_apart() -> None:
    model = _model("llama")
    for layer in model.layers:  # a bias on q alone: the three cannot share one product
        layer.self_attn.q_proj.bias = mx.zeros(layer.self_attn.q_proj.weight.shape[0])
    fusion = Fusion(model)
    assert len(fusion) == len(model.layers)  # gate/up still join
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear
