"""SIGTERM and SIGINT to a real server process with requests in flight: those that can finish
within the grace period finish, the rest get an error (an error event on a stream, an error body
otherwise), no connection is dropped, and the process exits with its engine thread joined. While
it starts, a signal (or the server killed outright) ends its engine process too."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.server import (
    ServerProcess,
    engine_child,
    group_alive,
    server_process,
    spawn_server,
)
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


@contextmanager
def starting(tiny_dir: Path, tmp_path: Path) -> Iterator[tuple[ServerProcess, int]]:
    """A server (in a process group of its own) whose engine process is held in its start-up
    with SIGSTOP: a model that takes minutes to load and warm (--batch-invariant's reference
    BLAS does), with no hook in the server. Yields the server and its engine process; whatever
    of the group is left at the end is killed."""
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info"]
    server = spawn_server([*args, "--engine", "process"], tmp_path, group=True)
    try:
        child = engine_child(server.proc.pid, wait_s=120)
        os.kill(child, signal.SIGSTOP)
        with pytest.raises(httpx.HTTPError):  # not serving: still starting
            httpx.get(server.base + "/health", timeout=2)
        yield server, child
    finally:
        for pid in group_alive(server.proc.pid):
            os.kill(pid, signal.SIGKILL)
        server.proc.wait(30)


def wait_group_gone(pgid: int, seconds: float) -> None:
    deadline = time.time() + seconds
    while left := group_alive(pgid):
        assert time.time() < deadline, f"still running after {seconds:g} s: {left}"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "sig, group, code", [(signal.SIGTERM, False, -signal.SIGTERM), (signal.SIGINT, True, 130)]
)
def test_a_signal_while_starting_ends_the_engine_process_too(
    tiny_dir: Path, tmp_path: Path, sig: signal.Signals, group: bool, code: int
) -> None:
    """SIGTERM to the server alone (a test's or a user's `kill`), SIGINT to its whole group
    (Ctrl-C) while its engine process loads: the engine process ignores both, the server ends
    it, then exits as a stopped server does; nothing of the group is left."""
    with starting(tiny_dir, tmp_path) as (server, child):
        (os.killpg if group else os.kill)(server.proc.pid, sig)
        assert server.proc.wait(30) == code
        wait_group_gone(server.proc.pid, 10)
        log = server.log()
    assert f"{sig.name}: ending the engine processes ({child})" in log, log[-3000:]
    assert "Traceback" not in log, log[-4000:]


def test_an_engine_process_whose_server_is_killed_ends_before_it_is_ready(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL leaves the server no say: its engine process, still loading, sees its parent
    gone and ends rather than load and warm for nobody (which it ignored SIGTERM through)."""
    with starting(tiny_dir, tmp_path) as (server, child):
        server.proc.kill()
        assert server.proc.wait(30) == -signal.SIGKILL
        os.kill(child, signal.SIGCONT)  # its load goes on, for nobody
        wait_group_gone(server.proc.pid, 60)
        log = server.log()
    assert "the server's process is gone: the engine process ends" in log, log[-3000:]
    assert "Traceback" not in log, log[-4000:]
