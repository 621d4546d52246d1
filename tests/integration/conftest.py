"""The real servers: `omlx-logprobs serve` under uvicorn on a loopback port, the embedded model
(the batch API's too); and those that several modules ask for with the same flags, started
once: the scripted reasoning model (test_thinking, test_thinking_budget) and the tiny model in
batch-invariant mode (test_batch_invariant, test_tinker)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.server import MAX_FILE_BYTES, ServerProcess, server_process


@pytest.fixture(scope="session")
def server(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded model; its batch folder a fresh one and its uploads bounded, for
    test_batches (which leaves it idle)."""
    batches = tmp_path_factory.mktemp("batches")
    args = ["--batch-dir", str(batches), "--max-file-bytes", str(MAX_FILE_BYTES)]
    with server_process(["--max-num-seqs", "32", *args, "--log-level", "warning"]) as s:
        yield s.base


@pytest.fixture(scope="session")
def thinker(scripted_path: Path) -> Iterator[str]:
    """The scripted reasoning model served with a prefill chunk shorter than its prompts and
    thinking budgets for two efforts (which apply only to a request naming one): one server
    for the reasoning tests and the budget tests, whose answers are closed forms."""
    args = ["--model", str(scripted_path), "--max-num-seqs", "32", "--prefill-chunk", "16"]
    args += ["--reasoning-budgets", "low=2,medium=4"]
    with server_process([*args, "--log-level", "warning"]) as s:
        yield s.base


@pytest.fixture(scope="session")
def invariant(tiny_dir: Path) -> Iterator[ServerProcess]:
    """The tiny model as "tiny" in batch-invariant mode, its engine in a process of its own (the
    mode's start-up check makes its start a slower one).
    What the modules do on it leaves the base model's answers as they were: Tinker's training
    is on LoRA sessions of its own."""
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--batch-invariant",
            "--max-num-seqs", "16", "--log-level", "warning"]  # fmt: skip
    with server_process(args) as s:
        yield s


@pytest.fixture(scope="session")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The same model in this process, for the independent reference computation."""
    return load_model()
