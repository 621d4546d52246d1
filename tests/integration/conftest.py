"""The real server: `omlx-logprobs serve` under uvicorn on a loopback port, the embedded model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.server import server_process


@pytest.fixture(scope="session")
def server(embedded_dir: Path) -> Iterator[str]:
    with server_process(["--max-num-seqs", "32", "--log-level", "warning"]) as s:
        yield s.base


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
