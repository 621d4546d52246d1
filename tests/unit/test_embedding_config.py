"""models/embedding.py: what a directory's sentence-transformers files and `--task` make of a
model (last-token pooling, Normalize, Matryoshka), and the directories it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omlx_logprobs.config import ServerConfig
from omlx_logprobs.models.embedding import read_embedding

POOL = "sentence_transformers.models."


def write(
    d: Path, config: dict[str, Any], modules: list[str] | None, pooling: str = "lasttoken"
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    if modules is not None:
        listed = [{"idx": i, "name": str(i), "path": f"{i}_{m}" if m != "Transformer" else "",
                   "type": POOL + m} for i, m in enumerate(modules)]  # fmt: skip
        (d / "modules.json").write_text(json.dumps(listed))
        (d / "1_Pooling").mkdir(exist_ok=True)
        (d / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{pooling}": True}))
    return d


def test_qwen3_embedding_files(tmp_path: Path) -> None:
    d = write(tmp_path, {"model_type": "qwen3"}, ["Transformer", "Pooling", "Normalize"])
    e = read_embedding(d)
    assert e is not None and e.normalize and e.matryoshka and e.hidden_size == 64
    assert e.check_dimensions(32) is None and e.check_dimensions(64) is None
    assert e.check_dimensions(0) and e.check_dimensions(65)
    assert read_embedding(d, "generate") is None


def test_other_families_and_declared_matryoshka(tmp_path: Path) -> None:
    d = write(tmp_path / "a", {"model_type": "llama"}, ["Transformer", "Pooling"])
    e = read_embedding(d)
    assert e is not None and not e.normalize and not e.matryoshka
    assert e.check_dimensions(32)  # not trained for it: refused
    d = write(tmp_path / "b", {"model_type": "llama", "matryoshka_dimensions": [32, 64]},
              ["Transformer", "Pooling", "Normalize"])  # fmt: skip
    e = read_embedding(d)
    assert e is not None and e.matryoshka and e.dimensions == (32, 64)
    assert e.check_dimensions(32) is None and e.check_dimensions(48)


def test_task_embed_without_files(tmp_path: Path) -> None:
    d = write(tmp_path, {"model_type": "llama"}, None)
    assert read_embedding(d) is None  # auto: a generative model
    e = read_embedding(d, "embed")
    assert e is not None and e.normalize and not e.matryoshka and e.source == "--task embed"
    with pytest.raises(ValueError, match="--task"):
        read_embedding(d, "pooling")


@pytest.mark.parametrize(
    ("modules", "pooling", "word"),
    [
        (["Transformer", "Pooling", "Normalize"], "mean_tokens", "mean_tokens"),
        (["Transformer", "Pooling", "Normalize"], "cls_token", "cls_token"),
        (["Transformer", "Pooling", "Dense", "Normalize"], "lasttoken", "Dense"),
    ],
)
def test_refused_at_start(tmp_path: Path, modules: list[str], pooling: str, word: str) -> None:
    d = write(tmp_path, {"model_type": "qwen2"}, modules, pooling)
    for task in ("auto", "embed"):
        with pytest.raises(ValueError, match=word):
            read_embedding(d, task)


def test_task_per_model() -> None:
    two = (("b", None),)
    cfg = ServerConfig(model="a", other_models=two, tasks=("embed", "generate"))
    assert (cfg.task(0), cfg.task(1)) == ("embed", "generate")
    assert ServerConfig(model="a", other_models=two, tasks=("embed",)).task(1) == "embed"
    assert ServerConfig(model="a").task(0) == "auto"
    with pytest.raises(ValueError, match="--task"):
        ServerConfig(model="a", other_models=two, tasks=("embed", "embed", "embed"))


@pytest.mark.parametrize(("pooling", "served"), [("mean_tokens", "mean"), ("cls_token", "cls")])
def test_encoder_poolings(tmp_path: Path, pooling: str, served: str) -> None:
    d = write(tmp_path, {"model_type": "bert"}, ["Transformer", "Pooling", "Normalize"], pooling)
    for task in ("auto", "embed"):
        e = read_embedding(d, task)
        assert e is not None and e.encoder and e.pooling == served and e.normalize
        assert not e.matryoshka
    with pytest.raises(ValueError, match="encoder"):
        read_embedding(d, "generate")


def test_encoder_without_files_and_refused(tmp_path: Path) -> None:
    e = read_embedding(write(tmp_path / "a", {"model_type": "bert"}, None))
    assert e is not None and e.encoder and e.pooling == "mean" and not e.normalize
    d = write(tmp_path / "b", {"model_type": "bert"}, ["Transformer", "Pooling"], "max_tokens")
    with pytest.raises(ValueError, match="max_tokens"):
        read_embedding(d)


def test_xlm_roberta_is_an_encoder_and_its_context(tmp_path: Path) -> None:
    from omlx_logprobs.models.card import native_context

    config = {"model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1}
    e = read_embedding(write(tmp_path, config, ["Transformer", "Pooling"], "cls_token"))
    assert e is not None and e.encoder and e.pooling == "cls" and not e.normalize
    assert native_context(config) == 512  # positions count from after the pad id
    assert native_context({"model_type": "bert", "max_position_embeddings": 512}) == 512
