"""Quantized mlx-lm directories (made here with mlx-lm's own convert from the tiny model) and the
dtype policy: on the CPU `auto` dequantizes them to float32 once at load, and the logprobs stay
mlx-lm's own forward of the quantized directory (float32 activations, the quantized matmul)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from omlx_logprobs.models.dtype import apply_dtype
from omlx_logprobs.models.loader import load_model
from tests.helpers.engine import reference_logprobs

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 2, 198, 1, 4093, 198, 1780, 314, 1]
# (bits, group size, mode): mlx-community's 4-bit and 8-bit affine, and gpt-oss's mxfp4.
KINDS = {"4bit": (4, 64, "affine"), "8bit": (8, 64, "affine"), "mxfp4": (4, 32, "mxfp4")}


def convert(tiny_dir: Path, out: Path, bits: int, group: int, mode: str) -> Path:
    from mlx_lm import convert as mlx_lm_convert

    mlx_lm_convert(
        str(tiny_dir), str(out), quantize=True, q_bits=bits, q_group_size=group, q_mode=mode
    )
    return out


@pytest.fixture(scope="module", params=list(KINDS))
def quantized_dir(
    request: pytest.FixtureRequest, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    bits, group, mode = KINDS[request.param]
    return convert(tiny_dir, tmp_path_factory.mktemp(request.param) / "model", bits, group, mode)


def _mlx_lm_logprobs(path: Path, ids: list[int]) -> np.ndarray:
    """mlx-lm's own load and forward of the directory, float32 activations (the CPU policy),
    its quantized layers as they are."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    net, _ = mlx_lm_load_model(path)
    net.set_dtype(mx.float32)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in net.named_modules())
    logits = np.array(net(mx.array([ids]))[0].astype(mx.float32), np.float64)
    m = logits.max(-1, keepdims=True)
    return (logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))).astype(np.float32)


def _quantized_layers(net: nn.Module) -> int:
    return sum(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in net.named_modules()
    )


def test_auto_on_the_cpu_dequantizes_and_keeps_the_logprobs(quantized_dir: Path) -> None:
    model = load_model(str(quantized_dir))
    assert _quantized_layers(model.model) == 0  # dequantized at load
    assert all(p.dtype == mx.float32 for _, p in nn.utils.tree_flatten(model.model.parameters()))
    got = reference_logprobs(model, PROMPT)
    want = _mlx_lm_logprobs(quantized_dir, PROMPT)
    diff = float(np.abs(got - want).max())
    print(f"{quantized_dir.parent.name}: max |logprob difference| {diff:.2e}")
    assert diff < 1e-4


def test_explicit_float32_keeps_the_layers_quantized(quantized_dir: Path) -> None:
    model = load_model(str(quantized_dir), dtype="float32")
    assert _quantized_layers(model.model) > 0
    diff = np.abs(reference_logprobs(model, PROMPT) - _mlx_lm_logprobs(quantized_dir, PROMPT))
    assert float(diff.max()) < 1e-5


def test_too_large_to_dequantize_stays_quantized(
    quantized_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omlx_logprobs.models import dtype

    monkeypatch.setattr(dtype, "_available_bytes", lambda: 1 << 20)
    model = load_model(str(quantized_dir))
    assert _quantized_layers(model.model) > 0


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_half_dtypes_cast_the_activations(tiny_dir: Path, name: str) -> None:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    net, _ = mlx_lm_load_model(tiny_dir)
    assert apply_dtype(net, name) == f"{name} activations"
    assert {p.dtype for _, p in nn.utils.tree_flatten(net.parameters())} == {getattr(mx, name)}
    with pytest.raises(ValueError, match="dtype must be one of"):
        apply_dtype(net, "int8")
