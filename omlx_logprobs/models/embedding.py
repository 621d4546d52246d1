"""Whether a model serves embeddings, and how, from its files and `--task`: sentence-transformers'
`modules.json` listing a Pooling module with `pooling_mode_lasttoken` (Qwen3-Embedding's), then
perhaps Normalize, makes a causal model an embedding model (`--task auto`); `--task embed`
makes any causal model one (its sentence-transformers pooling if it has one, else the last
token, normalized, as vLLM's `--convert embed` pools a causal model); `--task generate` none.

A causal model is pooled at its last token only: it is what a causal model's last position
holds, read in the engine's prefill (runner/pooling.py). An encoder model (BERT, XLM-R:
config.json's `model_type` among `ENCODER_FAMILIES`) only embeds, through `mlx-embeddings`' forward
(runner/encoder.py), pooled as its Pooling module says (mean, CLS or the last token; a
directory without modules.json: the mean, unnormalized, as sentence-transformers pools a bare
transformer). A directory whose modules pool otherwise or transform after pooling (Dense) is
refused at start rather than answered with other numbers.

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
# config.json's model_type of the encoders served through mlx-embeddings (runner/encoder.py):
# the families whose forward there takes the ids and a padding mask alone.
ENCODER_FAMILIES = ("bert", "xlm-roberta")
# The poolings served, as the wire and the log name them; sentence-transformers' mode of each.
POOLINGS = ("lasttoken", "mean", "cls")
_ST_MODES = {"lasttoken": "lasttoken", "mean_tokens": "mean", "cls_token": "cls"}


@dataclass(frozen=True)
class EmbeddingConfig:
    """How a model's embeddings are made from its last hidden state."""

    hidden_size: int  # the vector's width before any `dimensions`
    normalize: bool = True  # L2-normalized (sentence-transformers' Normalize module)
    matryoshka: bool = False  # `dimensions` may truncate it
    dimensions: tuple[int, ...] = ()  # the widths it was trained for, when its config lists them
    source: str = "sentence-transformers"  # what made it an embedding model (for the log)
    pooling: str = "lasttoken"  # one of POOLINGS
    encoder: bool = False  # an encoder model (runner/encoder.py): it embeds and nothing else

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
    that declares embeddings this server would not make as its modules do, and for an encoder
    model served to generate."""
    if task not in TASKS:
        raise ValueError(f"--task takes one of {', '.join(TASKS)}, not {task!r}")
    config = _json(path / "config.json") or {}
    text = config.get("text_config", config)
    family = str(config.get("model_type") or text.get("model_type") or "")
    encoder = family in ENCODER_FAMILIES
    if task == "generate":
        if encoder:
            raise ValueError(f"{path}: a {family} model is an encoder: it embeds, never generates")
        return None
    hidden = int(text.get("hidden_size") or config.get("hidden_size") or 0)
    modules = _json(path / "modules.json")
    if not isinstance(modules, list) or not _pooling_module(modules):
        if encoder:  # sentence-transformers' own default for a bare transformer: the mean
            return EmbeddingConfig(hidden, False, _declared(config), _dims(config),
                                   source=family, pooling="mean", encoder=True)  # fmt: skip
        if task == "embed":
            return EmbeddingConfig(hidden, matryoshka=_declared(config), dimensions=_dims(config),
                                   source="--task embed")  # fmt: skip
        return None
    pool = _json(path / _pooling_module(modules) / "config.json") or {}
    modes = [m for m in _MODES if pool.get(f"pooling_mode_{m}")]
    served = ["lasttoken", "mean_tokens", "cls_token"] if encoder else ["lasttoken"]
    if len(modes) != 1 or modes[0] not in served:
        raise ValueError(
            f"{path}: its sentence-transformers pooling is {', '.join(modes) or 'none'}; a"
            f" {'n encoder' if encoder else ' causal'} model is served pooled by"
            f" {' or '.join(served)} alone"
            + ("" if encoder else " (serve it with --task generate to generate)")
        )
    kinds = [str(m.get("type", "")).removeprefix(_MODULE) for m in modules]
    extra = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if extra:
        raise ValueError(
            f"{path}: its sentence-transformers modules include {extra[0]}, which this server"
            " does not apply" + ("" if encoder else " (serve it with --task generate to generate)")
        )
    matryoshka = _declared(config) or (family in _MATRYOSHKA_FAMILIES and not encoder)
    return EmbeddingConfig(hidden, "Normalize" in kinds, matryoshka, _dims(config),
                           pooling=_ST_MODES[modes[0]], encoder=encoder)  # fmt: skip


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
