"""The engine runs in a child process of the server: if that process dies, every request in
flight gets an OpenAI-shaped 500 naming the cause, /health answers 503 while a new child starts,
the log names the cause, and a request sent meanwhile waits for the new child and is served."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.helpers.server import assert_openai_error, engine_child, server_process
from tests.reliability.client import chat_body


def test_a_dead_engine_fails_requests_clearly(tiny_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info"]
    with server_process(args, tmp_path) as server:
        body = chat_body("Count to a thousand.", max_tokens=1500, ignore_eos=True)
        answers: list[httpx.Response] = []
        inflight = threading.Thread(
            target=lambda: answers.append(
                httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
            )
        )
        inflight.start()
        deadline = time.time() + 30
        while httpx.get(server.base + "/health").json()["engine"]["running"] == 0:
            assert not answers and time.time() < deadline, "the request never started"
            time.sleep(0.05)
        os.kill(engine_child(server.proc.pid), signal.SIGKILL)
        inflight.join(60)
        err = assert_openai_error(answers[0], 500, None)
        assert "engine process stopped (killed by SIGKILL)" in err["message"]
        health = httpx.get(server.base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine restarting"
        late = httpx.post(
            server.base + "/v1/chat/completions", json=chat_body("Hi", max_tokens=8), timeout=60
        )
        assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"]
        health = httpx.get(server.base + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert server.proc.poll() is None  # the HTTP server lived on
        log = server.log()
        assert "the engine process stopped (killed by SIGKILL)" in log and "is back" in log
