"""A client that goes away aborts its request: the engine frees its batch slot at the next step."""

from __future__ import annotations

import time

import httpx

from tests.integration.conftest import MODEL_NAME

LONG = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a very long story."}],
    "max_tokens": 4000,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 5,
}


def wait_idle(server: str, seconds: float = 20) -> int:
    deadline = time.time() + seconds
    running = -1
    while time.time() < deadline:
        running = httpx.get(server + "/health").json()["running"]
        if running == 0:
            return 0
        time.sleep(0.1)
    return running


def test_stream_disconnect_aborts(server: str) -> None:
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server + "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data:") for line in got)
            assert httpx.get(server + "/health").json()["running"] >= 1
    assert wait_idle(server) == 0


def test_non_stream_disconnect_aborts(server: str) -> None:
    try:
        httpx.post(server + "/v1/chat/completions", json=LONG, timeout=1.0)
    except httpx.TimeoutException:
        pass
    assert wait_idle(server) == 0
    # and the server still serves
    r = httpx.post(server + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
