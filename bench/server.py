"""Start and stop the server under test as a subprocess on a free loopback port.

A target is just the command line that serves an OpenAI-compatible API on a given port, so our
server and mlx-lm's own (`mlx_lm.server`) are measured by the same code.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.cpu_halves import server_affinity
from bench.presets import LONG_TOP

REPO = Path(__file__).resolve().parent.parent


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (our server's engine runs in a child process)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(p := todo.pop())
        todo += children.get(p, [])
    return tree


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, in MiB (host memory: not a GPU's)."""
    total = 0
    for p in process_tree(pid):
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
        total += int(m.group(1)) if m else 0
    return total / 1024


def free_port() -> int:
    # Bind to port 0 and give it back: the kernel hands out ports it has not used for a while,
    # so the race with another process taking it is negligible on a bench machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def omlx_command(port: int, model: str | None, max_num_seqs: int) -> list[str]:
    cmd = [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--max-logprobs", str(LONG_TOP)]  # the long top list's cell (presets.LONG_TOP)
    return cmd + (["--model", model] if model else [])


def mlx_lm_command(port: int, model: str, max_num_seqs: int) -> list[str]:
    """mlx-lm's own server, through `python -m bench.mlx_lm_server` (OpenBLAS as ours), run in
    the repo root (start_server's cwd). Its decode batch defaults to 32; it gets ours (64) so that
    concurrency 64 is not capped for it alone. Prefill batch: its default, 8."""
    cmd = [sys.executable, "-m", "bench.mlx_lm_server", "--model", model, "--host", "127.0.0.1"]
    return cmd + ["--port", str(port), "--decode-concurrency", str(max_num_seqs)]


@dataclass
class Server:
    command: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    startup_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def blas_line(self) -> str | None:
        """The `BLAS: ...` line our server logs at start (None for servers that do not)."""
        m = re.search(r"BLAS: (.*)", self.log_text())
        return m.group(1).strip() if m else None

    def log_problems(self) -> list[str]:
        """Log lines that look like server-side failures: tracebacks, errors, 5xx answers."""
        pat = re.compile(r"Traceback|^ERROR|\bERROR\b|\" 5\d\d ")
        return [ln for ln in self.log_text().splitlines() if pat.search(ln)]

    def cpu_s(self) -> float:
        """CPU seconds the server's processes (the server and its engine) have used so far."""
        ticks = 0
        for pid in process_tree(self.proc.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        """Resident memory of the server's processes (host memory: not the GPU's)."""
        return tree_rss_mib(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(
    command: list[str],
    port: int,
    health_path: str = "/health",
    timeout_s: float = 600.0,
    cpus: list[int] | None = None,
) -> Server:
    """Launch `command` and wait until `health_path` answers 200. The first start of our server
    converts the embedded GGUF (seconds), hence the generous timeout. `cpus`: the cores it runs
    on (else the --pin half's, if set)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else server_affinity()
    fd, name = tempfile.mkstemp(prefix="bench-server-", suffix=".log")
    log = os.fdopen(fd, "wb")
    # The server runs from the repo root so `-m omlx_logprobs` resolves to this checkout.
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=pin)
    log.close()
    server = Server(command, port, Path(name), proc)
    t0 = time.perf_counter()
    url = f"http://127.0.0.1:{port}{health_path}"
    while True:
        if proc.poll() is not None:
            tail = "\n".join(server.log_text().splitlines()[-30:])
            raise RuntimeError(f"server exited with {proc.returncode} before ready:\n{tail}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > timeout_s:
            server.stop()
            raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log: {name}")
        time.sleep(0.5)
    server.startup_s = time.perf_counter() - t0
    return server
