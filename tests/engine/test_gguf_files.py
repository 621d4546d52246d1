"""GGUF files as people have them: every quantization type, architecture and tokenizer kind that
we support, in files written here with the `gguf` package from known weights.

A converted tensor must equal what `gguf.quants.dequantize` (llama.cpp's arithmetic) gives for
the stored blocks, and a converted model must compute the logprobs of the same weights loaded
by mlx-lm itself from a Hugging Face-style directory.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from omlx_logprobs.models.gguf import convert_gguf
from omlx_logprobs.models.loader import load_model
from tests.helpers.gguf_files import gguf_name, write_gguf

VOCAB = 300
_BASE = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        **_BASE, "model_type": "llama", "rope_traditional": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
    },
    "qwen2": {**_BASE, "model_type": "qwen2", "tie_word_embeddings": False},
    "qwen3": {**_BASE, "model_type": "qwen3"},
    "qwen3_moe": {
        **_BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "tie_word_embeddings": False,
    },
    "gemma3_text": {
        **_BASE, "model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 8,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 16, "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
    },
    "phi3": {
        **{k: v for k, v in _BASE.items() if k != "head_dim"}, "model_type": "phi3",
        "tie_word_embeddings": False, "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 8 for i in range(8)],
                         "short_factor": [1.0 + i / 32 for i in range(8)]},
    },
}  # fmt: skip
PROMPT = [5, 17, 42, 99, 150, 7, 7, 260, 33, 64, 128, 200, 11, 12, 13, 250, 8, 90, 91, 92]


def _random_model(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded random weights of an mlx-lm model; vectors (norms, biases) moved off their
    defaults so that a norm offset or a lost bias would show."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in weights.items():
        a = np.array(w.astype(mx.float32))
        if a.ndim == 1:
            a = a + rng.normal(0, 0.2, a.shape).astype(np.float32)
        out[name] = a
    if config.get("tie_word_embeddings", False) or config["model_type"] == "gemma3_text":
        out.pop("lm_head.weight", None)
    return out


def _reference_dir(path: Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), arrays)
    return path


def _log_softmax(logits: mx.array) -> np.ndarray:
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _as_stored(weights: dict[str, np.ndarray], qtype: T) -> dict[str, np.ndarray]:
    """The weights a file of `qtype` holds, dequantized: what the converted model must compute
    with. Blocks run along rows, so llama.cpp's reordering of whole rows does not change them."""
    from tests.helpers.kquants import quantize

    if qtype == T.F32:
        return weights
    return {
        k: dequantize(quantize(w, qtype), qtype).reshape(w.shape) if w.ndim > 1 else w
        for k, w in weights.items()
    }


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logprobs_equal_mlx_lm(family: str, qtype: T, tmp_path: Path) -> None:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    config = FAMILIES[family]
    weights = _random_model(config, seed=7)
    gguf = tmp_path / f"{family}.gguf"
    write_gguf(gguf, config, weights, qtype=qtype)
    out = tmp_path / "converted"
    convert_gguf(gguf, out)
    ours = load_model(str(out))
    stored = _as_stored(weights, qtype)
    reference, _ = mlx_lm_load_model(_reference_dir(tmp_path / "ref", config, stored))
    reference.set_dtype(mx.float32)
    ids = mx.array([PROMPT])
    got, want = _log_softmax(ours.model(ids)[0]), _log_softmax(reference(ids)[0])
    assert got.shape == want.shape == (len(PROMPT), VOCAB)
    assert float(np.abs(want).max()) > 1.0  # not a flat distribution
    diff = float(np.abs(got - want).max())
    print(f"{family} {qtype.name}: max |logprob difference| {diff:.2e}")
    assert diff < 1e-4
    converted = json.loads((out / "config.json").read_text())
    assert converted["model_type"] == config["model_type"]
    assert converted["tie_word_embeddings"] == ("lm_head.weight" not in weights)


# Relative RMS error of our plain encoders (tests/helpers/kquants.py) and the package's, with
# room: the point is "close to the original", a wrong layout gives errors near 1.
_CLOSE = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 0.01, T.Q6_K: 0.04, T.Q5_0: 0.06,
          T.Q5_1: 0.06, T.Q5_K: 0.07, T.Q4_0: 0.12, T.Q4_1: 0.12, T.Q4_K: 0.12, T.Q3_K: 0.3,
          T.Q2_K: 0.5, T.MXFP4: 0.25}  # fmt: skip
_QUANT_CONFIG = {
    **FAMILIES["llama"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
    "head_dim": 64, "tie_word_embeddings": False, "rope_scaling": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def quant_weights() -> dict[str, np.ndarray]:
    return _random_model(_QUANT_CONFIG, seed=3)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("qtype", list(_CLOSE), ids=lambda t: t.name)
def test_quantization_type_converts_exactly(
    qtype: T, quant_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    gguf = tmp_path / f"{qtype.name}.gguf"
    write_gguf(gguf, _QUANT_CONFIG, quant_weights, qtype=qtype)
    stored = {t.name: t for t in GGUFReader(gguf).tensors}
    quantized = [n for n, t in stored.items() if t.tensor_type == qtype]
    assert len(quantized) >= 8  # every matrix, the embedding among them
    convert_gguf(gguf, tmp_path / "out")
    converted = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert set(converted) == set(quant_weights)
    for name, original in quant_weights.items():
        got = np.array(converted[name])
        t = stored[gguf_name(name, "llama")]
        # What llama.cpp computes from the stored blocks, in the Hugging Face row order.
        want = dequantize(np.asarray(t.data), t.tensor_type).reshape(original.shape)
        if ".q_proj." in name:
            want = _unpermute(want, _QUANT_CONFIG["num_attention_heads"])
        elif ".k_proj." in name:
            want = _unpermute(want, _QUANT_CONFIG["num_key_value_heads"])
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        err = np.sqrt(np.mean((got - original) ** 2) / np.mean(original**2))
        assert err <= _CLOSE[qtype], (name, float(err))
    model = load_model(str(tmp_path / "out")).model
    assert np.isfinite(np.array(model(mx.array([PROMPT])))).all()


# --- tokenizers -----------------------------------------------------------------------------------

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345 + 67890 = 80235; pi is 3.14159",
    "Emojis: 🦙🔥👍🏽 and 👨‍👩‍👧",
    "日本語のテキスト，中文文本，한국어",
    "  leading, inner   runs\n\n\n\ttabs\t\t and trailing   ",
    "It's the model's job; they'll see what we've done.",
]
# (tokenizer model, pre-tokenizer): Llama 3, Qwen2/3, GPT-2, SmolLM, Mistral's Tekken, and
# SentencePiece with a space prefix (Llama 2, Mistral v1, Phi-3) and without one (Gemma).
TOKENIZERS = [("gpt2", "llama-bpe"), ("gpt2", "qwen2"), ("gpt2", "gpt-2"), ("gpt2", "smollm"),
              ("gpt2", "tekken"), ("llama", ""), ("gemma", "")]  # fmt: skip


# Room for SentencePiece's 259 special and byte tokens besides the pieces.
TOKENIZER_CONFIG = {**FAMILIES["qwen3"], "num_hidden_layers": 1, "vocab_size": 400}


@pytest.fixture(scope="module")
def tokenizer_weights() -> dict[str, np.ndarray]:
    return _random_model(TOKENIZER_CONFIG, seed=5)


@pytest.mark.parametrize("kind,pre", TOKENIZERS)
def test_tokenizer_round_trips(
    kind: str, pre: str, tokenizer_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    config = TOKENIZER_CONFIG
    gguf = tmp_path / "tok.gguf"
    write_gguf(gguf, config, tokenizer_weights, tokenizer=kind, pre=pre)
    convert_gguf(gguf, tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    loaded = load_model(str(tmp_path / "out"), weights=False)
    bos = {"llama-bpe": "<|im_start|>", "": "<s>"}.get(pre)
    for text in TEXTS:
        ids = tok.encode(text)
        if bos is not None:
            assert ids[0] == tok.convert_tokens_to_ids(bos), text
            ids = ids[1:]
        assert tok.decode(ids) == text
        # Our vocabulary's token bytes (what logprob entries carry) spell the same text.
        # (SentencePiece with a space prefix spells the prefix too.)
        spelled = b"".join(loaded.vocab.token_bytes[i] or b"" for i in ids)
        assert spelled.decode("utf-8") == (" " + text if kind == "llama" else text), text
    assert max(tok.encode(TEXTS[0])) < config["vocab_size"]
    # Merges are used: a common word is one token, not bytes (a SentencePiece tokenizer with
    # a space prefix gives "the" its ▁ itself).
    word = "the" if kind == "llama" else " the"
    assert len(tok.encode(word, add_special_tokens=False)) == 1


def test_pre_tokenizers_split_as_named(
    tokenizer_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    """Digits: Llama 3 groups up to three, Qwen2, SmolLM and Tekken take them one by one."""
    from transformers import AutoTokenizer

    config = TOKENIZER_CONFIG
    counts = {}
    for pre in ("llama-bpe", "qwen2", "smollm", "gpt-2"):
        gguf = tmp_path / f"{pre}.gguf"
        write_gguf(gguf, config, tokenizer_weights, pre=pre)
        convert_gguf(gguf, tmp_path / pre)
        tok = AutoTokenizer.from_pretrained(tmp_path / pre)
        pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 1234567")
        counts[pre] = [p for p, _ in pieces]
    assert counts["llama-bpe"] == ["x", "Ġ", "123", "456", "7"]
    assert counts["qwen2"] == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert counts["gpt-2"] == ["x", "Ġ1234567"]


# --- refusals -------------------------------------------------------------------------------------


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'mamba'.*Hugging Face"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


def test_unsupported_pre_tokenizer_names_it(
    tokenizer_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    config = TOKENIZER_CONFIG
    write_gguf(tmp_path / "x.gguf", config, tokenizer_weights, pre="deepseek-coder")
    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-coder'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
