"""A client that goes away aborts its request: the engine frees its batch slot at the next step."""

from __future__ import annotations

import httpx

from tests.helpers.server import MODEL_NAME, wait_idle

LONG = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a very long story."}],
    "max_tokens": 4000,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 5,
}


def test_stream_disconnect_aborts(server: str) -> None:
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server + "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data:") for line in got)
            assert httpx.get(server + "/health").json()["running"] >= 1
    idle = wait_idle(server, 20)  # /health's "running" is the engine's waiting + running
    assert idle["waiting"] + idle["running"] == 0


def test_non_stream_disconnect_aborts(server: str) -> None:
    try:
        httpx.post(server + "/v1/chat/completions", json=LONG, timeout=1.0)
    except httpx.TimeoutException:
        pass
    idle = wait_idle(server, 20)  # /health's "running" is the engine's waiting + running
    assert idle["waiting"] + idle["running"] == 0
    # and the server still serves
    r = httpx.post(server + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
