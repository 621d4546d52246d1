"""Weights updated in place (`POST /update_weights_from_disk`) through the real server: the next
request computes with the new weights (against an independent forward pass of a model loaded
from them), a stream in flight keeps its weights or is aborted as asked, every body and chunk
names its weights, bad updates are 400s that leave the server serving, and a restarted engine
process comes back with the updated weights."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import moved_copy, reference_logprobs
from tests.helpers.server import ServerProcess, assert_openai_error, engine_child, server_process

PROMPT = "The quick brown fox jumps over the lazy"


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """The tiny model's directory with every weight moved: a policy after a training step."""
    return moved_copy(tiny_dir, tmp_path_factory.mktemp("tiny_next"))


@pytest.fixture(scope="module")
def foreign_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A safetensors file of another architecture (other names and shapes)."""
    path = tmp_path_factory.mktemp("foreign") / "other.safetensors"
    mx.save_safetensors(str(path), {"encoder.weight": mx.zeros((8, 8))})
    return path


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerProcess]:
    """A server of its own: its weights change under these tests."""
    with server_process(["--model", str(tiny_dir), "--log-level", "info"]) as s:
        yield s


def completion(base: str, **kw: Any) -> dict[str, Any]:
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, **kw}  # fmt: skip
    r = httpx.post(base + "/v1/completions", json={**body, "model": model_name(base)}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def model_name(base: str) -> str:
    return str(httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"])


def update(base: str, **body: Any) -> httpx.Response:
    return httpx.post(base + "/update_weights_from_disk", json=body, timeout=120)


def check_against(model: LoadedModel, body: dict[str, Any]) -> None:
    """The generated tokens' logprobs equal a full forward pass of `model` (1e-4)."""
    choice = body["choices"][0]
    prompt, out = choice["prompt_token_ids"], choice["token_ids"]
    ref = reference_logprobs(model, prompt + out)[len(prompt) - 1 : -1]
    got = choice["logprobs"]["token_logprobs"]
    for i, tok in enumerate(out):
        assert abs(got[i] - ref[i][tok]) < 1e-4, (i, got[i], ref[i][tok])


def test_update_between_two_requests(
    server: ServerProcess, tiny: LoadedModel, new_dir: Path
) -> None:
    before = completion(server.base)
    assert before["weight_version"] == {"counter": 0, "tag": None}
    check_against(tiny, before)
    r = update(server.base, model_path=str(new_dir), weight_version="step-1")
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == {"counter": 1, "tag": "step-1"}
    after = completion(server.base)
    assert after["weight_version"] == {"counter": 1, "tag": "step-1"}
    check_against(load_model(str(new_dir)), after)  # a model loaded from the new directory
    assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]
    health = httpx.get(server.base + "/health", timeout=10).json()
    assert health["weight_version"] == {"counter": 1, "tag": "step-1"}


def stream_with_update(base: str, path: Path, abort: bool) -> tuple[list[dict], dict]:
    """A long stream; once its first tokens arrived, an update (in a thread); the chunks and the
    update's answer."""
    body = {"model": model_name(base), "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "logprobs": 1, "stream": True}  # fmt: skip
    chunks: list[dict] = []
    answer: dict[str, Any] = {}

    def post() -> None:
        r = update(base, model_path=str(path), abort_in_flight=abort)
        answer.update(r.json(), status=r.status_code, at=time.monotonic())

    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        thread = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if thread is None and len(chunks) >= 3:
                thread = threading.Thread(target=post)
                thread.start()
        ended = time.monotonic()
    assert thread is not None
    thread.join(120)
    if not abort:  # the update waited for the stream
        assert answer["at"] >= ended - 0.5
    return chunks, answer


def test_stream_in_flight_finishes_on_its_weights(
    server: ServerProcess, tiny_dir: Path, tiny: LoadedModel
) -> None:
    version = completion(server.base)["weight_version"]
    chunks, answer = stream_with_update(server.base, tiny_dir, abort=False)
    assert answer["status"] == 200 and answer["aborted_requests"] == 0
    assert {json.dumps(c["weight_version"]) for c in chunks} == {json.dumps(version)}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    lps = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum(len(lp["tokens"]) for lp in lps if lp) == 400
    # The weights now serving are the tiny model's own again.
    check_against(tiny, completion(server.base))


def test_abort_in_flight(server: ServerProcess, new_dir: Path) -> None:
    version = completion(server.base)["weight_version"]
    chunks, answer = stream_with_update(server.base, new_dir, abort=True)
    assert answer["status"] == 200 and answer["aborted_requests"] == 1
    assert answer["weight_version"]["counter"] == version["counter"] + 1
    assert {json.dumps(c["weight_version"]) for c in chunks} == {json.dumps(version)}
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model_path": "/nonexistent/dir"}, "model_path"),
        ({"model_path": "FOREIGN"}, "model_path"),
        ({"model_path": "NEW", "flush_cache": False}, "flush_cache"),
        ({"model_path": "NEW", "abort": True}, "abort"),
        ({}, "model_path"),
    ],
)
def test_bad_updates_are_400s_and_change_nothing(
    server: ServerProcess, new_dir: Path, foreign_file: Path, body: dict, param: str
) -> None:
    before = completion(server.base)
    paths = {"FOREIGN": str(foreign_file), "NEW": str(new_dir)}
    body = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    err = assert_openai_error(update(server.base, **body), 400, param)
    if body.get("model_path") == str(foreign_file):
        assert "architecture" in err["message"]
    after = completion(server.base)
    assert after["weight_version"] == before["weight_version"]
    assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]


def test_a_restarted_engine_serves_the_updated_weights(
    server: ServerProcess, new_dir: Path
) -> None:
    r = update(server.base, model_path=str(new_dir), weight_version="kept")
    assert r.status_code == 200, r.text
    before = completion(server.base)
    os.kill(engine_child(server.proc.pid), signal.SIGKILL)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.5)
        h = httpx.get(server.base + "/health", timeout=10)
        if h.status_code == 200 and h.json()["engine"]["weights"]["tag"] == "kept":
            break
    after = completion(server.base)
    assert after["weight_version"] == before["weight_version"] == r.json()["weight_version"]
    np.testing.assert_allclose(
        after["choices"][0]["logprobs"]["token_logprobs"],
        before["choices"][0]["logprobs"]["token_logprobs"],
        atol=1e-5,
    )
