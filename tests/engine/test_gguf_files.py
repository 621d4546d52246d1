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
from omlx_logprobs.models.gguf.quantized import BITS
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
    # Ministral 3: YaRN rope scaling, and Llama 4's query temperature over an original context
    # of 8 tokens, so that the prompt crosses two steps of it.
    "ministral3": {
        **_BASE, "model_type": "ministral3", "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                            "original_max_position_embeddings": 8, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.1},
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
    if qtype != T.F32:  # its layers kept quantized (as on a GPU): MLX's quantized matmul
        kept = load_model(str(out), dtype="float32").model
        assert any(isinstance(m, nn.QuantizedLinear) for _, m in kept.named_modules())
        diff = float(np.abs(_log_softmax(kept(ids)[0]) - want).max())
        print(f"{family} {qtype.name}, quantized layers: max |logprob difference| {diff:.2e}")
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


def _stored_as_mlx(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    """What llama.cpp computes from a stored tensor's blocks, in the Hugging Face row order."""
    want = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
    if ".attn_q." in t.name:
        return _unpermute(want, _QUANT_CONFIG["num_attention_heads"])
    if ".attn_k." in t.name:
        return _unpermute(want, _QUANT_CONFIG["num_key_value_heads"])
    return want


def _dequantized(converted: dict[str, mx.array], name: str, quant: dict[str, Any]) -> np.ndarray:
    """A converted weight's values: itself, or MLX's dequantization of its packed codes."""
    path = name.removesuffix(".weight")
    if path not in quant:
        return np.array(converted[name])
    q = quant[path]
    assert converted[name].dtype == mx.uint32
    assert converted[f"{path}.scales"].dtype == converted[f"{path}.biases"].dtype == mx.float32
    scales, biases = converted[f"{path}.scales"], converted[f"{path}.biases"]
    w = mx.dequantize(converted[name], scales, biases, group_size=q["group_size"], bits=q["bits"],
                      stream=mx.cpu)  # fmt: skip
    return np.array(w)


@pytest.mark.parametrize("qtype", list(_CLOSE), ids=lambda t: t.name)
def test_quantization_type_converts_exactly(
    qtype: T, quant_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    """Types that MLX's affine quantization represents become quantized layers whose
    dequantization is gguf's, bit for bit; the others float32 weights equal to gguf's."""
    gguf = tmp_path / f"{qtype.name}.gguf"
    write_gguf(gguf, _QUANT_CONFIG, quant_weights, qtype=qtype)
    stored = {t.name: t for t in GGUFReader(gguf).tensors}
    quantized = [n for n, t in stored.items() if t.tensor_type == qtype]
    assert len(quantized) >= 8  # every matrix, the embedding among them
    convert_gguf(gguf, tmp_path / "out")
    converted = mx.load(str(tmp_path / "out" / "model.safetensors"))
    quant = json.loads((tmp_path / "out" / "config.json").read_text()).get("quantization", {})
    matrices = {n.removesuffix(".weight") for n, w in quant_weights.items() if w.ndim > 1}
    if qtype in BITS:
        assert set(quant) - {"group_size", "bits", "mode"} == matrices
        assert all(quant[p] == {"group_size": 32, "bits": BITS[qtype]} for p in matrices)
    else:
        assert quant == {}
    loaded = load_model(str(tmp_path / "out"), dtype="float32").model  # layers kept quantized
    layers = dict(loaded.named_modules())
    on_cpu = mx.default_device() == mx.cpu
    served = load_model(str(tmp_path / "out")).model  # auto on the CPU: dequantized at load
    served_weights = dict(nn.utils.tree_flatten(served.parameters()))  # type: ignore[attr-defined]
    for name, original in quant_weights.items():
        path = name.removesuffix(".weight")
        got = _dequantized(converted, name, quant)
        want = _stored_as_mlx(stored[gguf_name(name, "llama")], original.shape)
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        if on_cpu:  # a GPU keeps the layers quantized under auto
            assert np.array_equal(np.array(served_weights[name]), want), name
        if path in quant:  # the loaded layer's own arrays dequantize to gguf's values
            layer = layers[path]
            assert isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding), path
            assert (layer.bits, layer.group_size) == (BITS[qtype], 32)
            own = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32,
                                bits=layer.bits, stream=mx.cpu)  # fmt: skip
            assert np.array_equal(np.array(own), want), name
        err = np.sqrt(np.mean((got - original) ** 2) / np.mean(original**2))
        assert err <= _CLOSE[qtype], (name, float(err))
    assert np.isfinite(np.array(loaded(mx.array([PROMPT])))).all()


def test_mixed_types_in_one_file(quant_weights: dict[str, np.ndarray], tmp_path: Path) -> None:
    """As in a Q4_K_M file: Q4_K matrices, Q6_K ones (left float32: sub-blocks of 16) and a
    Q8_0 one; each quantized layer gets its own bits, and the model's logprobs, kept quantized,
    equal a float32 forward of the weights gguf dequantizes (within 1e-4)."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    types = {n: T.Q4_K for n in quant_weights}
    types |= {n: T.Q6_K for n in quant_weights if "v_proj" in n or "down_proj" in n}
    types |= {n: T.Q8_0 for n in quant_weights if "o_proj" in n}
    types["model.layers.0.mlp.up_proj.weight"] = T.Q5_K
    gguf = tmp_path / "mixed.gguf"
    write_gguf(gguf, _QUANT_CONFIG, quant_weights, types=types)
    convert_gguf(gguf, tmp_path / "out")
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    want_bits = {
        n.removesuffix(".weight"): BITS[t]
        for n, t in types.items()
        if quant_weights[n].ndim > 1 and t in BITS
    }
    assert {p: q["bits"] for p, q in quant.items() if isinstance(q, dict)} == want_bits
    assert set(want_bits.values()) == {4, 5, 8}
    ours = load_model(str(tmp_path / "out"), dtype="float32")
    layers = dict(ours.model.named_modules())
    for path, bits in want_bits.items():
        assert layers[path].bits == bits, path
    assert isinstance(layers["model.layers.0.self_attn.v_proj"], nn.Linear)  # Q6_K: float32
    stored = {t.name: t for t in GGUFReader(gguf).tensors}
    reference_weights = {
        n: _stored_as_mlx(stored[gguf_name(n, "llama")], w.shape) if w.ndim > 1 else w
        for n, w in quant_weights.items()
    }
    reference, _ = mlx_lm_load_model(
        _reference_dir(tmp_path / "ref", _QUANT_CONFIG, reference_weights)
    )
    reference.set_dtype(mx.float32)
    ids = mx.array([PROMPT])
    got, want = _log_softmax(ours.model(ids)[0]), _log_softmax(reference(ids)[0])
    assert float(np.abs(want).max()) > 1.0
    diff = float(np.abs(got - want).max())
    print(f"mixed Q4_K/Q5_K/Q6_K/Q8_0, quantized layers: max |logprob difference| {diff:.2e}")
    assert diff < 1e-4


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
