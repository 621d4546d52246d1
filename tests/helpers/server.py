"""Real servers on loopback and what the tests ask them: `omlx-logprobs serve` as a process, or
`create_app` under uvicorn in a thread (for models wrapped in-process: faults, other settings),
/health until the engine is idle, one chat request through the `openai` client, and the
OpenAI-shaped error check."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import uvicorn

from omlx_logprobs.api.app import create_app
from omlx_logprobs.api.core.sampled import MAX_ANSWERS
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.config import Access, EngineConfig, Limits
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient, ThreadTransport
from omlx_logprobs.types import THINK_TAGS

if TYPE_CHECKING:
    import openai

MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded model, as served
TINY_NAME = "tiny"  # the tiny model, as the reliability servers serve it
# The session's embedded-model server (tests/integration/conftest.py): --max-file-bytes, its
# uploads' bound (test_batches refuses one byte past it)
MAX_FILE_BYTES = 100_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    base: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)


def spawn_server(
    args: list[str], log_dir: Path | None = None, group: bool = False
) -> ServerProcess:
    """`omlx-logprobs serve ARGS` started on a free loopback port (`server_process` says
    what the arguments mean), not waited for."""
    port = free_port()
    log_path = Path(log_dir or tempfile.gettempdir()) / f"omlx-server-{port}.log"
    with open(log_path, "wb") as log:
        cmd = [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--port", str(port), *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=group)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def group_alive(pgid: int) -> list[int]:
    """The processes of a process group still running (zombies, whose parent has not yet
    reaped them, aside)."""
    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


@contextmanager
def server_process(
    args: list[str], log_dir: Path | None = None, start_s: float = 180, group: bool = False
) -> Iterator[ServerProcess]:
    """`omlx-logprobs serve ARGS` as a real process on a free loopback port, its output in
    LOG_DIR (default: the temporary directory); stopped with SIGTERM (SIGKILL after 15 s).
    `group`: in a process group of its own (its id the server's), as a service manager starts
    it, so that a signal can reach the server and its engine process together (`os.killpg`)."""
    server = spawn_server(args, log_dir, group)
    proc = server.proc
    try:
        deadline = time.time() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{server.log()[-3000:]}")
            try:
                if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server did not start in {start_s:g} s; see {server.log_path}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


@contextmanager
def thread_server(
    model: LoadedModel,
    cfg: EngineConfig | None = None,
    limits: Limits | None = None,
    access: Access | None = None,
    reasoning: bool = False,
    tool_format: str = "none",
    reasoning_tags: tuple[str, str] = THINK_TAGS,
    metrics: bool = True,
    faithful_answers: int = MAX_ANSWERS,
) -> Iterator[tuple[str, Engine]]:
    """`create_app` under a real uvicorn server in a thread; yields (base URL, engine).
    `reasoning`: the thinking parser on (what `--reasoning-parser` turns on); `metrics` and
    `faithful_answers`: what `--no-metrics` and `--faithful-answers` set."""
    cfg = cfg or EngineConfig(max_num_seqs=64, prefill_chunk=64)
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, tokenizer=model.tokenizer)
    client = EngineClient(ThreadTransport(engine))
    served = Served(
        client,
        model,
        cfg,
        reasoning=reasoning,
        tool_format=tool_format,
        reasoning_tags=reasoning_tags,
        limits=limits or Limits(),
        faithful_answers=faithful_answers,
    )
    app = create_app(served, access, metrics=metrics)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(30)


def wait_idle(base: str, seconds: float = 30.0) -> dict[str, Any]:
    """/health's engine block once nothing is queued, running, holding a cache row or still in
    flight (a step launched before the last abort holds its arrays until it is processed)."""
    deadline = time.time() + seconds
    stats: dict[str, Any] = {}
    while time.time() < deadline:
        stats = httpx.get(base + "/health", timeout=10).json()["engine"]
        idle = stats["waiting"] == stats["running"] == stats["cached_sequences"] == 0
        if idle and not stats["step_in_flight"]:
            return stats
        time.sleep(0.05)
    return stats


def chat(client: openai.OpenAI, q: str, **kw: Any) -> Any:
    """One user message to the embedded model through the `openai` client."""
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": q}], **kw
    )


def assert_openai_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return dict(err)


def assert_api_error(r: httpx.Response, status: int, param: str | None, path: str) -> None:
    """The error shape of the API `path` belongs to: OpenAI's (naming `param`), Anthropic's
    (`/v1/messages`) or Ollama's (`/api/`), whose messages name the field."""
    assert r.status_code == status, r.text
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        message = body["error"]["message"]
    elif path.startswith("/api/"):
        assert set(body) == {"error"}, body
        message = body["error"]
    else:
        assert_openai_error(r, status, param)
        return
    assert isinstance(message, str) and (param is None or param.split("[")[0] in message), body


def engine_child(pid: int, wait_s: float = 0.0) -> int:
    """The server's engine process (its multiprocessing spawn child, not the resource tracker);
    `wait_s`: how long to wait for it to be started."""
    deadline = time.time() + wait_s
    while True:
        found = _engine_child(pid)
        if found is not None:
            return found
        if time.time() > deadline:
            raise AssertionError(f"no engine process under {pid}")
        time.sleep(0.05)


def _engine_child(pid: int) -> int | None:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            cmd = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in text and b"spawn_main" in cmd:
            return int(status.parent.name)
    return None
