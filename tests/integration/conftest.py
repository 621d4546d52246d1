"""The real server: `omlx-logprobs serve` under uvicorn on a loopback port, the embedded model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model

MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def launch(*args: str) -> Iterator[str]:
    """`omlx-logprobs serve ARGS` on a free loopback port; yields its base URL."""
    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"omlx-server-{port}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early; see {log.name}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("server did not start in 120 s")
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def server(embedded_dir: Path) -> Iterator[str]:
    with launch("--max-num-seqs", "32", "--log-level", "warning") as base:
        yield base


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
