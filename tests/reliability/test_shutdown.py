"""SIGTERM and SIGINT to a real server process with requests in flight: those that can finish
within the grace period finish, the rest get an error (an error event on a stream, an error body
otherwise), no connection is dropped, and the process exits with its engine thread joined."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.server import engine_child, server_process
from tests.reliability.client import ChatResult, chat, chat_body

GRACE_S = 3


def long(stream: bool) -> dict[str, Any]:
    return chat_body(
        "Go on forever.", max_tokens=2000, ignore_eos=True, stream=stream, logprobs=True
    )


async def in_flight(base: str, proc_signal: Any) -> tuple[list[ChatResult], float]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        bodies = [long(True), long(True), long(False), long(False)]
        tasks = [asyncio.ensure_future(chat(c, b)) for b in bodies]
        deadline = time.time() + 60
        while httpx.get(base + "/health").json()["engine"]["running"] < 4:
            assert time.time() < deadline, "the long requests never started"
            await asyncio.sleep(0.05)
        short = chat_body("Hi", max_tokens=8, temperature=0)
        tasks.append(asyncio.ensure_future(chat(c, short)))  # can finish within the grace
        await asyncio.sleep(0.05)
        signalled = time.time()
        proc_signal()
        return list(await asyncio.gather(*tasks)), signalled


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_signal_finishes_or_fails_in_flight_then_exits(
    tiny_dir: Path, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info"]
    args += ["--shutdown-grace", str(GRACE_S)]
    with server_process(args, tmp_path) as server:
        results, signalled = asyncio.run(
            in_flight(server.base, lambda: server.proc.send_signal(sig))
        )
        assert server.proc.wait(GRACE_S + 30) == code
        exited = time.time() - signalled
        log = server.log()
    streams, plains, short = results[:2], results[2:4], results[4]
    assert short.status == 200 and short.error is None and short.finish_reason == "length"
    for r in streams:  # the 200 had started: the error arrives as an event, then [DONE]
        assert r.status == 200 and r.error is not None, r
        assert "shutting down" in r.error["message"] and r.aligned and r.token_ids
    for r in plains:
        assert r.status == 500 and r.error is not None and "shutting down" in r.error["message"]
    assert GRACE_S - 0.5 < exited < GRACE_S + 20, exited
    assert "threads left: none" in log, log[-2000:]
    assert "Traceback" not in log, log[-4000:]


def test_sigterm_to_the_process_group_leaves_shutdown_to_the_server(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A service manager's stop (systemd's KillMode=control-group) sends SIGTERM to the engine
    process too: it ignores it and the server stops it, once drained, with its `Stop` command,
    so that the prefix cache's disk tier is written; no engine is restarted meanwhile."""
    disk = tmp_path / "kv"
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info"]
    args += ["--engine", "process", "--kv-cache-dir", str(disk), "--shutdown-grace", "2"]
    with server_process(args, tmp_path, group=True) as server:
        child = engine_child(server.proc.pid)
        body = chat_body("Remember this conversation.", max_tokens=8, temperature=0)
        answer = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert not list(disk.rglob("*.safetensors"))  # kept in memory until the shutdown
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(30) == -signal.SIGTERM
        log = server.log()
    assert "the engine process stopped" not in log and "restarting" not in log, log[-3000:]
    assert "Traceback" not in log, log[-4000:]
    deadline = time.time() + 10
    while Path(f"/proc/{child}").exists():  # the engine process exits too, once stopped
        assert time.time() < deadline, "the engine process outlived the server"
        time.sleep(0.1)
    files = list(disk.rglob("*.safetensors"))
    assert len(files) == 1 and files[0].stat().st_size > 0, files
