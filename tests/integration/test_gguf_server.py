"""A GGUF file that mixes block types as a Q4_K_M file does (Q4_K, Q5_K, Q6_K, Q8_0), written here
with the `gguf` package, served through the real server and the `openai` client with its layers
kept quantized (`--dtype float32`, what `auto` does on a GPU): every logprob equals a float32
forward of the weights the `gguf` package dequantizes from the file (within 1e-4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, LlamaFileType

from tests.engine.test_gguf_files import (
    _QUANT_CONFIG,
    _log_softmax,
    _random_model,
    _reference_dir,
    _stored_as_mlx,
)
from tests.helpers.engine import completion_difference
from tests.helpers.gguf_files import gguf_name, write_gguf
from tests.helpers.server import ServerProcess, server_process

PROMPT = [5, 17, 42, 99, 150, 7, 7, 260, 33, 64, 128, 200, 11, 12, 13, 250, 8, 90]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The file, and an mlx-lm directory of the float32 weights gguf dequantizes from it."""
    root = tmp_path_factory.mktemp("gguf-mixed")
    weights = _random_model(_QUANT_CONFIG, seed=11)
    types = {n: T.Q4_K for n in weights}
    types |= {n: T.Q6_K for n in weights if "v_proj" in n or "lm_head" in n}
    types |= {n: T.Q8_0 for n in weights if "o_proj" in n}
    types |= {n: T.Q5_K for n in weights if "down_proj" in n}
    path = root / "mixed-Q4_K_M.gguf"
    write_gguf(path, _QUANT_CONFIG, weights, types=types, file_type=LlamaFileType.MOSTLY_Q4_K_M)
    stored = {t.name: t for t in GGUFReader(path).tensors}
    dequantized = {
        n: _stored_as_mlx(stored[gguf_name(n, "llama")], w.shape) if w.ndim > 1 else w
        for n, w in weights.items()
    }
    return path, _reference_dir(root / "ref", _QUANT_CONFIG, dequantized)


@pytest.fixture(scope="module")
def served(
    gguf_file: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OMLX_LOGPROBS_CACHE", str(tmp_path_factory.mktemp("conversions")))
    try:
        args = ["--model", str(gguf_file[0]), "--dtype", "float32", "--log-level", "info"]
        with server_process(args) as s:
            yield s
    finally:
        mp.undo()


def _reference(ref_dir: Path, ids: list[int]) -> np.ndarray:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    net, _ = mlx_lm_load_model(ref_dir)
    net.set_dtype(mx.float32)
    return _log_softmax(net(mx.array([ids]))[0])


def test_quantized_gguf_logprobs_through_the_server(
    served: ServerProcess, gguf_file: tuple[Path, Path]
) -> None:
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model="mixed-Q4_K_M",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=5,
        extra_body={"prompt_logprobs": 5, "return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0]
    ref = _reference(gguf_file[1], PROMPT + c.model_extra["token_ids"])
    assert completion_difference(c, PROMPT, ref) < 1e-4
    assert "quantized layers kept" in served.log()


def test_model_lists_describe_the_file(served: ServerProcess, gguf_file: tuple[Path, Path]) -> None:
    """Ollama's list and show, and /v1/models, from the GGUF file's own facts: its size on
    disk (not the memory its weights take once loaded), its file type, its tensors' count."""
    path = gguf_file[0]
    parameters = sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    listed = ollama.Client(host=served.base).list().models
    assert [m.model for m in listed] == ["mixed-Q4_K_M"]
    assert listed[0].size == path.stat().st_size
    details = listed[0].details
    assert details is not None and details.format == "gguf" and details.family == "llama"
    assert details.quantization_level == "Q4_K_M"
    unit, scale = ("M", 1e6) if parameters >= 1e6 else ("K", 1e3)
    assert details.parameter_size == f"{parameters / scale:.3g}{unit}"
    shown = ollama.Client(host=served.base).show("mixed-Q4_K_M")
    context = _QUANT_CONFIG.get("max_position_embeddings", 4096)
    assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] == context
    assert shown.modelinfo["general.parameter_count"] == parameters
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0)
    card = client.models.list().data[0]
    assert card.model_extra is not None and card.model_extra["max_model_len"] == context
