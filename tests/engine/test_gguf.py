"""The GGUF -> mlx-lm conversion of the embedded SmolLM2-135M-Instruct.

The model check is independent of the converter: a numpy float32 llama forward pass that reads the
GGUF tensors as stored (llama.cpp's permuted q/k rows, interleaved rope) and dequantizes them
itself must give the same log-probabilities as mlx-lm running the converted directory.
"""

from __future__ import annotations

import os

import omlx_logprobs  # noqa: F401  (first: it preloads OpenBLAS, which must precede mlx)

os.environ["HF_HUB_OFFLINE"] = "1"  # never touch the hub, whatever transformers decides

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.embedded import embedded_gguf_path, ensure_embedded_model
from omlx_logprobs.models.gguf import convert_gguf, read_tensor_types

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
LOGPROB_TOLERANCE = 3e-4


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return embedded_gguf_path()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def model_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh conversion (not the user's cache), so that the converter itself is under test."""
    cache = tmp_path_factory.mktemp("cache")
    yield ensure_embedded_model(cache)
    shutil.rmtree(cache, ignore_errors=True)  # pytest would keep 3 runs of it


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def mlx_model(model_dir: Path) -> tuple[Any, Any]:
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))[:2]
    return model, tokenizer


# --- cache -------------------------------------------------------------------------------------


def test_cache_is_reused(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ensure_embedded_model(model_dir.parent) == model_dir
    assert capsys.readouterr().err == ""  # no second conversion
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name]  # no temp dirs
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == [2, 0]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)


def test_unsupported_gguf_is_refused(tmp_path: Path) -> None:
    bad_arch = tmp_path / "bad_arch.gguf"
    mx.save_gguf(str(bad_arch), {"x.weight": mx.zeros((2, 32))}, {"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        convert_gguf(bad_arch, tmp_path / "out1")
    bad_type = tmp_path / "bad_type.gguf"
    ints = {"token_embd.weight": mx.zeros((2, 32), dtype=mx.int32)}
    mx.save_gguf(str(bad_type), ints, {"general.architecture": "llama"})
    assert read_tensor_types(bad_type) == {"token_embd.weight": 26}  # GGML_TYPE_I32
    with pytest.raises(ValueError, match="unsupported GGUF tensor type 26"):
        convert_gguf(bad_type, tmp_path / "out2")


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "12345 + 67890 = 80235; pi is 3.14159",
        "Emojis: 🦙🔥👍🏽 and 👨‍👩‍👧",
        "日本語のテキスト，中文文本，한국어",
        "  leading, inner   runs\n\n\n\ttabs\t\t and trailing   ",
        "",
    ],
)
def test_round_trip(hf_tokenizer: Any, text: str) -> None:
    ids = hf_tokenizer.encode(text, add_special_tokens=True)
    assert hf_tokenizer.decode(ids) == text


def test_digits_are_split_one_by_one(hf_tokenizer: Any) -> None:
    assert len(hf_tokenizer.encode("12345")) == 5


def test_special_tokens(hf_tokenizer: Any) -> None:
    for token, token_id in [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)]:
        assert hf_tokenizer.encode(token) == [token_id]
    assert hf_tokenizer.encode("<|im_start|>user\nHi<|im_end|>")[:1] == [1]  # no BOS added
    assert hf_tokenizer.eos_token == "<|im_end|>"


def test_chat_template(hf_tokenizer: Any) -> None:
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_mlx_lm_tokenizer(mlx_model: tuple[Any, Any]) -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    _, tokenizer = mlx_model
    assert tokenizer.eos_token_ids == {0, 2}
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    detok = tokenizer.detokenizer
    detok.reset()
    for t in tokenizer.encode("Streaming 🦙 text, 東京"):
        detok.add_token(t)
    detok.finalize()
    assert detok.text == "Streaming 🦙 text, 東京"


# --- model: an independent numpy llama forward pass over the raw GGUF tensors -------------------


def _dequantize(tensors: dict[str, mx.array], name: str) -> np.ndarray:
    """Unpack MLX affine-quantized (weight, scales, biases) with numpy, group size 32."""
    w = np.array(tensors[f"{name}.weight"])
    if f"{name}.scales" not in tensors:
        return w.astype(np.float32)
    scales = np.array(tensors[f"{name}.scales"]).astype(np.float32)
    biases = np.array(tensors[f"{name}.biases"]).astype(np.float32)
    rows, in_dim = w.shape[0], scales.shape[1] * 32
    packed = w.view(np.uint8)  # element i of a row sits in the low bits first (little-endian)
    if packed.shape[1] == in_dim:  # 8 bits
        q = packed
    else:  # 4 bits: low nibble is the even element
        q = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, in_dim)
    groups = q.reshape(rows, -1, 32).astype(np.float32)
    return (groups * scales[..., None] + biases[..., None]).reshape(rows, in_dim)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def _rope_interleaved(x: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's rope for llama: rotate adjacent pairs (0, 1), (2, 3), ... of each head."""
    seq, _, dim = x.shape
    freqs = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(seq)[:, None] * freqs[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out.astype(np.float32)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    seq, n_head, dim = q.shape
    group = n_head // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    scores[:, np.triu(np.ones((seq, seq), dtype=bool), 1)] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(seq, n_head * dim)


def _numpy_llama_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    loaded = mx.load(str(gguf), return_metadata=True)
    tensors, md = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)

    def meta(key: str) -> Any:
        return np.array(md[f"llama.{key}"]).item()

    n_head, n_kv = meta("attention.head_count"), meta("attention.head_count_kv")
    eps, base = meta("attention.layer_norm_rms_epsilon"), meta("rope.freq_base")
    embed = _dequantize(tensors, "token_embd")
    x = embed[ids]
    for i in range(meta("block_count")):
        p = f"blk.{i}"
        h = _rms_norm(x, _dequantize(tensors, f"{p}.attn_norm"), eps)
        q = (h @ _dequantize(tensors, f"{p}.attn_q").T).reshape(len(ids), n_head, -1)
        k = (h @ _dequantize(tensors, f"{p}.attn_k").T).reshape(len(ids), n_kv, -1)
        v = (h @ _dequantize(tensors, f"{p}.attn_v").T).reshape(len(ids), n_kv, -1)
        attn = _attention(_rope_interleaved(q, base), _rope_interleaved(k, base), v)
        x = x + attn @ _dequantize(tensors, f"{p}.attn_output").T
        h = _rms_norm(x, _dequantize(tensors, f"{p}.ffn_norm"), eps)
        gate = h @ _dequantize(tensors, f"{p}.ffn_gate").T
        up = h @ _dequantize(tensors, f"{p}.ffn_up").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ _dequantize(tensors, f"{p}.ffn_down").T
    x = _rms_norm(x, _dequantize(tensors, "output_norm"), eps)
    head = _dequantize(tensors, "output") if "output.weight" in tensors else embed
    return (x @ head.T).astype(np.float32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float32)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_logprobs_match_numpy_reference(gguf_path: Path, mlx_model: tuple[Any, Any]) -> None:
    model, tokenizer = mlx_model
    ids = tokenizer.encode("<|im_start|>user\nName three primes below 20; why isn't 1 prime?")
    assert 15 <= len(ids) <= 30
    ours = _log_softmax(np.array(model(mx.array([ids]))[0]))
    reference = _log_softmax(_numpy_llama_logits(gguf_path, ids))
    diff = float(np.max(np.abs(ours - reference)))
    print(f"max |logprob difference| over {ours.shape} (positions x vocab): {diff:.2e}")
    assert diff < LOGPROB_TOLERANCE
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


def test_greedy_answer(mlx_model: tuple[Any, Any]) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = mlx_model
    cache = make_prompt_cache(model)
    step = mx.array([tokenizer.encode(CHAT_PROMPT)])
    out: list[int] = []
    for _ in range(8):
        logits = model(step, cache=cache)[0, -1]
        out.append(int(np.argmax(np.array(logits))))
        step = mx.array([out[-1:]])
    text = tokenizer.decode(out)
    print(f"greedy continuation: {text!r}")
    assert "Paris" in text
