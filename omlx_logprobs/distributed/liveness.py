"""Whether the other ranks of a distributed group are alive, apart from MLX's collectives.

A rank that dies mid-step leaves rank 0 waiting: MLX's ring backend sees the closed socket and
fails the collective it was running, but a step's graph holds many collectives, and the array
rank 0 waits on (the step's sampled ids) then never completes (seen with MLX 0.32.4). So each
follower keeps one TCP connection to rank 0 and writes a byte every `BEAT_S`; rank 0 reads
them. A dead process closes its connection at once (the kernel does it), a network split stops
the bytes: rank 0 knows within `BEAT_S`..`SILENT_S` and declares the group lost without waiting
for MLX. The same connection tells a follower that rank 0 is gone.

Rank 0 listens on its own address as the launcher gave it to the others (the ring's hostfile,
NCCL's or JACCL's coordinator); where none is known (MPI), only the watchdog's timeout is left.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("omlx_logprobs")

BEAT_S = 0.5  # a follower's heartbeat
SILENT_S = 5.0  # rank 0 declares a follower lost after this long without a byte


def rank0_address() -> str | None:
    """Rank 0's IP as mlx.launch gave it to every rank, or None."""
    env = os.environ
    if "NCCL_HOST_IP" in env:
        return env["NCCL_HOST_IP"]
    if "MLX_JACCL_COORDINATOR" in env:
        return env["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0]
    hostfile = env.get("MLX_HOSTFILE")
    if hostfile:
        try:
            text = Path(hostfile).read_text() if Path(hostfile).is_file() else hostfile
            first = json.loads(text)[0]
            return str(first[0] if isinstance(first, list) else first).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, TypeError):
            return None
    return None


class Listener:
    """Rank 0's end: accepts one connection per follower and watches each."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_server((address, 0))
        self.port = self.sock.getsockname()[1]
        self._on_lost: Callable[[str], None] | None = None
        self._watchers: list[threading.Thread] = []

    def start(self, followers: dict[int, str], on_lost: Callable[[str], None]) -> None:
        """Watch every rank in `followers` (rank -> host); `on_lost(why)` once one is lost."""
        self._on_lost = on_lost
        self._waiting = dict(followers)
        threading.Thread(target=self._accept, name="omlx-liveness", daemon=True).start()

    def _accept(self) -> None:
        while self._waiting:
            conn, _ = self.sock.accept()
            conn.settimeout(SILENT_S)
            try:
                rank = int.from_bytes(conn.recv(4), "little")
            except (OSError, ValueError):
                conn.close()
                continue
            host = self._waiting.pop(rank, None)
            if host is None:  # not a rank we wait for: ignored
                conn.close()
                continue
            watcher = threading.Thread(
                target=self._watch,
                args=(conn, rank, host),
                name=f"omlx-liveness-{rank}",
                daemon=True,
            )
            watcher.start()
            self._watchers.append(watcher)
        self.sock.close()

    def join(self, timeout: float) -> None:
        """After a clean stop: the followers exit and their links close; wait for that."""
        deadline = time.monotonic() + timeout
        for watcher in list(self._watchers):
            watcher.join(max(deadline - time.monotonic(), 0))

    def _watch(self, conn: socket.socket, rank: int, host: str) -> None:
        while True:
            try:
                data = conn.recv(64)
            except TimeoutError:
                why = f"rank {rank} on {host} sent nothing for {SILENT_S:g} s (network down?)"
                break
            except OSError as exc:
                why = f"rank {rank} on {host} is gone ({exc})"
                break
            if not data:
                why = f"rank {rank} on {host} is gone (its process ended)"
                break
        conn.close()
        assert self._on_lost is not None
        self._on_lost(why)


def keep_alive(address: str, port: int, rank: int, on_lost: Callable[[str], None]) -> None:
    """A follower's end, on a thread of its own: connect to rank 0 and beat until rank 0's
    end closes; then `on_lost(why)`."""

    def beat() -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = socket.create_connection((address, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    on_lost(f"rank 0's liveness port {address}:{port} cannot be reached")
                    return
                time.sleep(0.5)
        try:
            conn.sendall(rank.to_bytes(4, "little"))
            while True:
                conn.sendall(b".")
                time.sleep(BEAT_S)
        except OSError as exc:
            on_lost(f"rank 0 is gone ({exc})")

    threading.Thread(target=beat, name="omlx-liveness", daemon=True).start()
