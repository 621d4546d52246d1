"""A tiny Qwen3-Embedding-like model directory (a 2-layer qwen3 with seeded random weights,
SmolLM2's tokenizer made to append `<|endoftext|>` as Qwen3-Embedding's does, and the
sentence-transformers files of Qwen3-Embedding: last-token pooling, then Normalize), and the
reference: sentence-transformers' own encode of the same directory on transformers' float32
forward (torch on the CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen3

QWEN3_EMBEDDING = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 49152,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,  # as Qwen3-Embedding-0.6B's
    "torch_dtype": "float32",
    "eos_token_id": 0,
}
QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)

# Qwen3-Embedding's tokenizer.json post-processor: every encoded text gets `<|endoftext|>`
# (SmolLM2's id 0; Qwen's 151643), the position whose hidden state is the embedding.
_APPEND_EOS = {
    "type": "TemplateProcessing",
    "single": [
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
    ],
    "pair": [
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
        {"Sequence": {"id": "B", "type_id": 1}},
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}},
    ],
    "special_tokens": {
        "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
    },
}
_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
_POOLING = {
    "word_embedding_dimension": 64,
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": True,
    "include_prompt": True,
}


def embedding_model_dir(
    out: Path, tokenizer_dir: Path, seed: int = 4321, tied: bool = True
) -> Path:
    """The directory, saved as Qwen3-Embedding's are (transformers' base model alone: no
    `model.` prefix, no head; `tied`: tie_word_embeddings, as the 0.6B's, else as the 4B's)."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "Sequence", "processors": [tok["post_processor"], _APPEND_EOS]}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps({**QWEN3_EMBEDDING, "tie_word_embeddings": tied}))
    (out / "modules.json").write_text(json.dumps(_MODULES))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(_POOLING))
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False})
    )
    prompts = {"query": QUERY_PROMPT, "document": ""}
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"}
        )
    )
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(QWEN3_EMBEDDING))
    model.model.embed_tokens.weight = mx.random.normal((49152, 64)) * 0.15
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    base = {k.removeprefix("model."): w for k, w in weights.items() if k.startswith("model.")}
    mx.save_safetensors(str(out / "model.safetensors"), base)
    return out


def reference_embeddings(path: Path, texts: list[str], **encode: Any) -> np.ndarray:
    """sentence-transformers' embeddings of `texts` (its Transformer, Pooling and Normalize
    modules as the directory lists them; float32 on the CPU), each text encoded alone (no
    padding in the reference)."""
    from sentence_transformers import SentenceTransformer

    st = _loaded(str(path))
    assert isinstance(st, SentenceTransformer)
    return np.stack([st.encode([t], convert_to_numpy=True, **encode)[0] for t in texts])


_models: dict[str, Any] = {}


def _loaded(path: str) -> Any:
    if path not in _models:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.manual_seed(0)
        _models[path] = SentenceTransformer(
            path, device="cpu", model_kwargs={"dtype": torch.float32}
        )
    return _models[path]


def compare(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(cosine, max abs difference) of two vectors."""
    cos = float(np.dot(got, want) / (np.linalg.norm(got) * np.linalg.norm(want)))
    return cos, float(np.abs(got - want).max())


def close(got: Any, want: np.ndarray) -> None:
    """Equal within 1e-4: cosine > 0.99999 and every component within 1e-4."""
    cos, worst = compare(np.asarray(got, np.float32), want)
    assert cos > 0.99999 and worst < 1e-4, (cos, worst)
