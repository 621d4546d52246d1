"""runner/fast/lean_decode.py: the lean decode step gives the model's own logits and leaves the
caches as the model's forward does, step after step of a left-padded batch, in each family it
serves (llama, qwen2 with its biases, qwen3 with its head norms); it follows new weights after
`reset`, and stays off the families and batches it does not serve. It takes several positions
a row too (a speculative step's verify), with the same logits and caches."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.fast import lean_decode
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.fast.lean_decode import LeanDecode
from tests.helpers.families import FAMILIES, _model_class

PROMPTS = mx.array([[0, 5, 17, 301], [0, 0, 44, 9], [7, 8, 9, 10]])
PADS = [1, 2, 0]


def _model(model_type: str = "llama", seed: int = 3, **extra: Any) -> Any:
    mx.random.seed(seed)
    model_cls, args_cls = _model_class(model_type)
    config = {"model_type": model_type, **FAMILIES[model_type], **extra}
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    return model


def _prefilled(model: Any) -> BatchCache:
    cache = BatchCache.for_prompts(make_prompt_cache(model), PADS)
    model(PROMPTS, cache=cache.layers)
    cache.reserve(16)
    return cache


def _lean(model: Any, full_width: bool = False) -> LeanDecode:
    fusion = Fusion(model)
    assert lean_decode.eligible(model, fusion, make_prompt_cache(model)) is None
    return LeanDecode(model, fusion, full_width)


def _steps(model: Any, lean: LeanDecode | None, n: int = 6) -> tuple[list[np.ndarray], Any]:
    """n greedy decode steps, through the lean step or the model's forward."""
    cache = _prefilled(model)
    tokens = mx.array([[11], [12], [13]])
    out = []
    for _ in range(n):
        if lean is not None:
            assert lean.supports(cache)
            logits = lean(tokens, cache)
        else:
            logits = model(tokens, cache=cache.layers)[:, -1, :]
        out.append(np.array(logits.astype(mx.float32)))
        tokens = mx.argmax(logits, axis=-1)[:, None]
    return out, cache


def _same_caches(a: BatchCache, b: BatchCache) -> None:
    for x, y in zip(a.layers, b.layers):
        assert x._idx == y._idx
        assert np.array_equal(np.array(x.offset), np.array(y.offset))
        for u, v in ((x.keys, y.keys), (x.values, y.values)):
            np.testing.assert_allclose(
                np.array(u[..., : x._idx, :]), np.array(v[..., : y._idx, :]), atol=1e-5
            )


@pytest.mark.parametrize("full_width", [False, True], ids=["written columns", "full width"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3"])
def test_lean_steps_are_the_models_own(model_type: str, full_width: bool) -> None:
    """Attention over the written columns (the CPU) or over the whole width with the rest
    masked out (a GPU): the model's logits and caches either way."""
    model = _model(model_type)
    want, plain = _steps(model, None)
    got, leaned = _steps(model, _lean(model, full_width))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    _same_caches(leaned, plain)


def _verifies(model: Any, lean: LeanDecode | None) -> tuple[list[np.ndarray], Any]:
    """A plain step, then verify steps of 4, 2 and 9 positions a row, through the lean step or
    the model's forward: [B, n, V] logits each."""
    cache = _prefilled(model)
    out = []
    for i, n in enumerate((1, 4, 2, 9)):
        ids = mx.array([[(7 * i + 3 * r + j) % 50 for j in range(n)] for r in range(3)])
        if lean is not None:
            assert lean.supports(cache, n)
            logits = lean(ids, cache)
            logits = logits[:, None] if n == 1 else logits
        else:
            logits = model(ids, cache=cache.layers)
        out.append(np.array(logits.astype(mx.float32)))
    return out, cache


@pytest.mark.parametrize("full_width", [False, True], ids=["written columns", "full width"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3"])
def test_several_positions_a_row_are_the_models_own(model_type: str, full_width: bool) -> None:
    """Each row's n positions attend to its earlier columns and to each other causally, never
    to its padding or to columns not written yet."""
    model = _model(model_type)
    want, plain = _verifies(model, None)
    got, leaned = _verifies(model, _lean(model, full_width))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    _same_caches(leaned, plain)


def test_a_cache_without_room_for_the_positions_is_not_served() -> None:
    model = _model()
    cache = _prefilled(model)
    room = cache.layers[0].keys.shape[2] - cache.layers[0]._idx
    lean = _lean(model)
    assert lean.supports(cache, room) and not lean.supports(cache, room + 1)


@pytest.mark.parametrize("variant", ["tied head and biases", "4-bit weights"])
def test_tied_head_biases_and_quantized_weights(variant: str) -> None:
    if variant == "4-bit weights":
        model = _model()
        nn.quantize(model, group_size=32, bits=4)
        assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    else:
        model = _model(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
        assert "lm_head" not in model and "bias" in model.layers[0].self_attn.q_proj
    want, _ = _steps(model, None)
    got, _ = _steps(model, _lean(model))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


def test_phi3_partial_and_scaled_rotation() -> None:
    """phi3's own joined layers, half of each head rotated, with its long-context scaling."""
    factors = {"short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0], "type": "longrope"}
    model = _model(
        "phi3", partial_rotary_factor=0.5, rope_scaling=factors, max_position_embeddings=8192
    )
    assert type(model.layers[0].self_attn.rope).__name__ == "SuScaledRoPE"
    want, _ = _steps(model, None)
    got, _ = _steps(model, _lean(model, full_width=True))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_reset_follows_new_weights() -> None:
    model, fresh = _model(seed=3), _model(seed=4)
    lean = _lean(model)
    _steps(model, lean, 1)  # the transposes of the old weights are made
    model.load_weights(list(tree_flatten(fresh.parameters())), strict=True)
    lean.fusion.rejoin()
    lean.reset()
    want, _ = _steps(fresh, None, 2)
    got, _ = _steps(model, lean, 2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_a_full_cache_takes_the_models_forward() -> None:
    model = _model()
    lean = _lean(model)
    cache = _prefilled(model)
    first = cache.layers[0]
    first._idx = first.keys.shape[2]  # no column left: the model's forward grows the cache
    assert not lean.supports(cache)


def test_other_families_and_settings_are_refused() -> None:
    for other in ("gemma2", "gemma3_text", "qwen3_moe"):
        m = _model(other)
        assert lean_decode.eligible(m, Fusion(m), make_prompt_cache(m)) is not None
    llama = _model()
    apart = Fusion(llama)
    apart.groups = []  # as with OMLX_FUSE_PROJECTIONS=0
    assert "joined" in str(lean_decode.eligible(llama, apart, make_prompt_cache(llama)))


def test_start_up_check_passes_and_catches_a_wrong_step() -> None:
    model = _model()
    lean = _lean(model)
    templates = make_prompt_cache(model)
    assert lean_decode.check(lean, templates) is None
    lean._build()
    assert lean._blocks is not None
    lean._blocks[0].o.wt = lean._blocks[0].o.wt * 2  # a wrong weight: the check says so
    assert "differ" in str(lean_decode.check(lean, templates))
