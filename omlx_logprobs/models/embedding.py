"""Whether a model serves embeddings, and how, from its files and `--task`: sentence-transformers'
`modules.json` listing a Pooling module with `pooling_mode_lasttoken` (Qwen3-Embedding's), then
perhaps Normalize, makes a causal model an embedding model (`--task auto`); `--task embed`
makes any causal model one (its sentence-transformers pooling if it has one, else the last
token, normalized, as vLLM's `--convert embed` pools a causal model); `--task generate` none.

Only last-token pooling is served: it is what a causal model's last position holds, read in
the engine's prefill (runner/pooling.py). A directory whose modules pool otherwise (mean, CLS)
or transform after pooling (Dense) is refused at start rather than answered with other numbers.

`dimensions` (OpenAI's, Ollama's) truncates a vector and normalizes it again, which only a
model trained with Matryoshka Representation Learning keeps meaningful: vLLM's config keys say
so (`is_matryoshka`, `matryoshka_dimensions` in config.json), and Qwen3-Embedding is (its
model card: every dimension from 32 to its width), known here as a qwen3 model whose
sentence-transformers files pool the last token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TASKS = ("auto", "generate", "embed")
_MODULE = "sentence_transformers.models."
_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
          "weightedmean_tokens", "lasttoken")  # fmt: skip
_MATRYOSHKA_FAMILIES = ("qwen3",)  # with sentence-transformers' last-token pooling


@dataclass(frozen=True)
class EmbeddingConfig:
    """How a model's embeddings are made from its last hidden state."""

    hidden_size: int  # the vector's width before any `dimensions`
    normalize: bool = True  # L2-normalized (sentence-transformers' Normalize module)
    matryoshka: bool = False  # `dimensions` may truncate it
    dimensions: tuple[int, ...] = ()  # the widths it was trained for, when its config lists them
    source: str = "sentence-transformers"  # what made it an embedding model (for the log)

    def check_dimensions(self, n: int) -> str | None:
        """Why `dimensions` n cannot be served (None: it can), in vLLM's words where it has
        them."""
        if not self.matryoshka:
            return (
                "This model is not trained with Matryoshka Representation Learning: changing"
                " the output dimensions would give poor results."
            )
        if self.dimensions and n not in self.dimensions:
            return f"This model supports only the dimensions {list(self.dimensions)}."
        if not 1 <= n <= self.hidden_size:
            return f"dimensions must be between 1 and {self.hidden_size}."
        return None


def read_embedding(path: Path, task: str = "auto") -> EmbeddingConfig | None:
    """The model's embedding config, None for a generative model; ValueError for a directory
    that declares embeddings this server would not make as its modules do."""
    if task not in TASKS:
        raise ValueError(f"--task takes one of {', '.join(TASKS)}, not {task!r}")
    if task == "generate":
        return None
    config = _json(path / "config.json") or {}
    text = config.get("text_config", config)
    hidden = int(text.get("hidden_size") or config.get("hidden_size") or 0)
    modules = _json(path / "modules.json")
    if not isinstance(modules, list) or not _pooling_module(modules):
        if task == "embed":
            return EmbeddingConfig(hidden, matryoshka=_declared(config), dimensions=_dims(config),
                                   source="--task embed")  # fmt: skip
        return None
    pool = _json(path / _pooling_module(modules) / "config.json") or {}
    modes = [m for m in _MODES if pool.get(f"pooling_mode_{m}")]
    if modes != ["lasttoken"]:
        raise ValueError(
            f"{path}: its sentence-transformers pooling is {', '.join(modes) or 'none'}; only"
            " last-token pooling is served (serve it with --task generate to generate)"
        )
    kinds = [str(m.get("type", "")).removeprefix(_MODULE) for m in modules]
    extra = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if extra:
        raise ValueError(
            f"{path}: its sentence-transformers modules include {extra[0]}, which this server"
            " does not apply (serve it with --task generate to generate)"
        )
    family = str(config.get("model_type") or text.get("model_type") or "")
    matryoshka = _declared(config) or family in _MATRYOSHKA_FAMILIES
    return EmbeddingConfig(hidden, "Normalize" in kinds, matryoshka, _dims(config))


def _pooling_module(modules: list[Any]) -> str:
    """The folder of the Pooling module ("" where none is listed)."""
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
            return str(m.get("path") or "1_Pooling")
    return ""


def _declared(config: dict[str, Any]) -> bool:
    return bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))


def _dims(config: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in config.get("matryoshka_dimensions") or ())


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
