"""`omlx-logprobs serve` as a group of processes on this machine, the ring backend over loopback:
under `mlx.launch` (as a user starts it), or each rank started here with the environment
mlx.launch would give it (so that a test can kill one rank and watch rank 0 alone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.helpers.server import free_port

MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"


@dataclass
class Group:
    base: str
    log_path: Path
    launcher: subprocess.Popen[bytes] | None  # mlx.launch, when it started the ranks
    ranks: dict[int, psutil.Process] = field(default_factory=dict)  # the serving processes

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response:
        return httpx.get(self.base + "/health", timeout=5)


def _ring_ports() -> int:
    """A port whose next one is free too (the ring backend listens on one port per rank)."""
    for _ in range(50):
        port = free_port()
        if port < 65000:
            try:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def _serving(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The rank processes under mlx.launch, by MLX_RANK (not rank 0's engine child)."""
    out = {}
    for p in launcher.children(recursive=True):
        try:
            if "serve" in p.cmdline() and "--model" in p.cmdline():
                out[int(p.environ()["MLX_RANK"])] = p
        except (psutil.Error, KeyError, ValueError):
            continue
    return out


@contextmanager
def group_server(
    model: Path,
    args: list[str] | None = None,
    launcher: bool = True,
    start_s: float = 300,
    entry: tuple[str, ...] = ("-m", "omlx_logprobs.cli"),
) -> Iterator[Group]:
    """Two ranks serving `model`; stopped with SIGTERM to rank 0 (which stops the others),
    every process of ours killed by its id after 30 s. `entry`: what python runs (a script
    path instead of the module: tests/helpers/gpu_path_serve.py)."""
    port, ring = free_port(), _ring_ports()
    log_path = Path(tempfile.gettempdir()) / f"omlx-group-{port}.log"
    serve = [*entry, "serve", "--model", str(model), "--port", str(port)]
    serve += args or []
    with ExitStack() as stack:
        log = stack.enter_context(open(log_path, "wb"))
        if launcher:
            cmd = [str(MLX_LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(ring)]
            cmd += ["--python", sys.executable, "--", *serve]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            group = Group(f"http://127.0.0.1:{port}", log_path, proc)
        else:
            hostfile = Path(tempfile.gettempdir()) / f"omlx-group-{port}.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
            group = Group(f"http://127.0.0.1:{port}", log_path, None)
            for rank in (0, 1):
                env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
                p = subprocess.Popen(
                    [sys.executable, *serve], stdout=log, stderr=subprocess.STDOUT, env=env
                )
                group.ranks[rank] = psutil.Process(p.pid)
        try:
            _wait_up(group, start_s)
            yield group
        finally:
            _stop(group)


def run_to_exit(model: Path, args: list[str], timeout_s: float = 120) -> str:
    """Two ranks under mlx.launch expected to stop by themselves (a start-up refused on every
    rank); everything they wrote. Whatever of ours is left after `timeout_s` is killed, each
    by its id, and the test fails."""
    port, ring = free_port(), _ring_ports()
    cmd = [str(MLX_LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(ring)]
    cmd += ["--python", sys.executable, "--", "-m", "omlx_logprobs.cli", "serve"]
    cmd += ["--model", str(model), "--port", str(port), *args]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        launcher = psutil.Process(proc.pid)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            ours = [launcher, *launcher.children(recursive=True)]
            for p in ours:
                p.kill()
            psutil.wait_procs(ours, timeout=10)
            raise
        out.seek(0)
        return out.read().decode(errors="replace")


def _wait_up(group: Group, start_s: float) -> None:
    deadline = time.time() + start_s
    while True:
        if group.launcher is not None:
            if group.launcher.poll() is not None:
                raise RuntimeError(f"mlx.launch exited early:\n{group.log()[-3000:]}")
            group.ranks = _serving(psutil.Process(group.launcher.pid)) or group.ranks
        elif any(
            not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in group.ranks.values()
        ):
            raise RuntimeError(f"a rank exited early:\n{group.log()[-3000:]}")
        try:
            if group.health().status_code == 200 and len(group.ranks) == 2:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"the group did not start in {start_s:g} s; see {group.log_path}")
        time.sleep(0.3)


def _stop(group: Group) -> None:
    """SIGTERM to rank 0; whatever of ours is left after 30 s is killed, each by its id."""
    ours = list(group.ranks.values())
    if group.launcher is not None:
        try:
            ours = [psutil.Process(group.launcher.pid)] + ours
            ours += psutil.Process(group.launcher.pid).children(recursive=True)
        except psutil.Error:
            pass
    rank0 = group.ranks.get(0)
    if rank0 is not None and rank0.is_running():
        rank0.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(ours, timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    if group.launcher is not None:
        group.launcher.wait(10)
