"""vLLM's sleep mode through a real server (docs/specs/rl.md, "Sleep and wake"): /sleep at level
1 and 2, /is_sleeping, a completion while asleep is vLLM's 503, and after /wake_up the same
greedy completion gives the same tokens and logprobs; /collective_rpc reload_weights after the
weights on disk changed serves the new weights (against a full forward of a model loaded from
them, 1e-4); bad input is a 400 in OpenAI's shape. The level is the engine's alone: an engine
process killed asleep comes back awake, and /is_sleeping says so."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx_logprobs.models.loader import load_model
from tests.helpers.engine import moved_copy, reference_logprobs
from tests.helpers.server import (
    ServerProcess,
    assert_openai_error,
    engine_child,
    server_process,
)

PROMPT = "The quick brown fox jumps over the lazy"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """The server's own copy of the tiny model: its weights on disk change under a test."""
    out = tmp_path_factory.mktemp("served")
    shutil.copytree(tiny_dir, out, dirs_exist_ok=True)
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with server_process(["--model", str(model_dir), "--log-level", "info"]) as s:
        yield s


def complete(base: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    body["model"] = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(base + "/v1/completions", json=body, timeout=60)


def numbers(r: httpx.Response) -> tuple[list[int], list[float]]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def sleeping(base: str) -> Any:
    r = httpx.get(base + "/is_sleeping", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_serves_the_same_numbers(server: ServerProcess, level: int) -> None:
    before = numbers(complete(server.base))
    r = httpx.post(server.base + "/sleep", params={"level": level}, timeout=60)
    assert r.status_code == 200, r.text
    assert sleeping(server.base) == {"is_sleeping": True}
    err = assert_openai_error(complete(server.base), 503, None)
    assert err["type"] == "ModelSleepingError" and "/wake_up" in err["message"]
    assert httpx.get(server.base + "/v1/models", timeout=10).status_code == 200  # no weights
    tags = {"tags": ["weights", "kv_cache"]} if level == 2 else None
    r = httpx.post(server.base + "/wake_up", params=tags, timeout=60)
    assert r.status_code == 200, r.text
    assert sleeping(server.base) == {"is_sleeping": False}
    assert numbers(complete(server.base)) == before  # bit for bit


def test_bad_input_is_a_400(server: ServerProcess) -> None:
    base = server.base
    assert_openai_error(httpx.post(base + "/sleep", params={"level": 3}, timeout=10), 400, "level")
    assert_openai_error(httpx.post(base + "/sleep", json={"x": 1}, timeout=10), 400, "x")
    r = httpx.post(base + "/wake_up", params={"tags": "gpu"}, timeout=10)
    assert_openai_error(r, 400, "tags")
    r = httpx.post(base + "/collective_rpc", json={"method": "save_model"}, timeout=10)
    assert "save_model" in assert_openai_error(r, 400, "method")["message"]
    rpc = {"method": "reload_weights", "kwargs": {"strict": True}}
    r = httpx.post(base + "/collective_rpc", json=rpc, timeout=10)
    assert_openai_error(r, 400, "kwargs.strict")
    assert sleeping(base) == {"is_sleeping": False}  # nothing changed
    numbers(complete(base))


def test_reload_weights_serves_the_weights_on_disk(
    server: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    """A trainer wrote new weights into the model's directory: reload_weights serves them (as a
    new weight version), even from a level-2 sleep (vLLM's sleep, reload, wake)."""
    before = complete(server.base).json()
    new = moved_copy(model_dir, tmp_path)
    shutil.copy(new / "model.safetensors", model_dir / "model.safetensors")
    assert httpx.post(server.base + "/sleep?level=2", timeout=60).status_code == 200
    r = httpx.post(server.base + "/collective_rpc", json={"method": "reload_weights"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json() == {"results": [None]}
    assert httpx.post(server.base + "/wake_up", timeout=60).status_code == 200
    body = complete(server.base).json()
    assert body["weight_version"]["counter"] == before["weight_version"]["counter"] + 1
    choice = body["choices"][0]
    prompt, out = choice["prompt_token_ids"], choice["token_ids"]
    ref = reference_logprobs(load_model(str(new)), prompt + out)[len(prompt) - 1 : -1]
    got = choice["logprobs"]["token_logprobs"]
    for i, tok in enumerate(out):
        assert abs(got[i] - ref[i][tok]) < 1e-4, (i, got[i], ref[i][tok])
    assert got != before["choices"][0]["logprobs"]["token_logprobs"]


def test_a_restarted_engine_is_awake(server: ServerProcess) -> None:
    """The engine process killed asleep: the new one starts awake (its weights read at start),
    and /is_sleeping reads that from it, not from what the API last asked."""
    before = numbers(complete(server.base))
    assert httpx.post(server.base + "/sleep", params={"level": 2}, timeout=60).status_code == 200
    assert sleeping(server.base) == {"is_sleeping": True}
    first = engine_child(server.proc.pid)
    os.kill(first, signal.SIGKILL)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.5)
        h = httpx.get(server.base + "/health", timeout=10)
        if h.status_code == 200 and h.json()["engine"] is not None:
            break
    assert engine_child(server.proc.pid) != first
    assert sleeping(server.base) == {"is_sleeping": False}
    assert numbers(complete(server.base)) == before  # served, not the sleeping 503
