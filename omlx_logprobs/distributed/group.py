"""The process group a model is split over (distributed/distributed.py has the whole design):
whether this process is one rank of a group started by `mlx.launch`, joining the group, the
one-way channel from rank 0 to every other rank over all-sums, and every rank's start-up
record."""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger("omlx_logprobs")

BLOCK = 4096  # bytes of a command's first all-sum: its length and most commands whole
INFO_BYTES = 1024  # each rank's start-up record
GROUP_START_S = float(os.environ.get("OMLX_GROUP_START_S", "600"))  # ranks start this far apart


class GroupLost(RuntimeError):
    """The processes the model is split over can no longer run a step."""


# ---- the launch environment ----------------------------------------------------------------------
def launched() -> bool:
    """Started by mlx.launch (or mpirun): one rank of a group."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def rank_from_env() -> int:
    return int(os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)


def backend_from_env() -> str:
    """The backend mlx.launch set up, read from what it exports for each."""
    env = os.environ
    if "NCCL_HOST_IP" in env:
        return "nccl"
    if "MLX_JACCL_COORDINATOR" in env:
        return "jaccl"
    if "MLX_HOSTFILE" in env:
        return "ring"
    if "OMPI_COMM_WORLD_RANK" in env or "MLX_MPI_LIBNAME" in env:
        return "mpi"
    return "any"


def init_group() -> tuple[Any, str]:
    """Join the group. The ranks reach this point at different times (rank 0 loads its
    tokenizer and starts its engine process first), and a ring rank gives up connecting to a
    peer that is not listening yet after a few tries: so it tries again, for up to
    GROUP_START_S."""
    backend = backend_from_env()
    deadline = time.monotonic() + GROUP_START_S
    while True:
        try:
            return mx.distributed.init(strict=True, backend=backend), backend
        except RuntimeError as exc:
            if "connect" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            log.info("waiting for the other ranks: %s", exc)
            time.sleep(1.0)


# ---- one-way messages over collectives -----------------------------------------------------------
class Channel:
    """Rank 0 to every other rank: a pickled object as all-sums (see distributed/distributed.py's
    docstring). The bytes travel as int32 lanes, a type every backend sums (NCCL, MPI, ring,
    JACCL)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._queued: list[mx.array] = []  # rank 0's last command, kept until it has run

    def send(self, obj: Any, wait: bool = False) -> None:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        raw = len(data).to_bytes(8, "little") + data
        raw += bytes(max(BLOCK, len(raw) + -len(raw) % 4) - len(raw))
        lanes = np.frombuffer(raw, np.int32)
        arrays = [mx.distributed.all_sum(mx.array(lanes[: BLOCK // 4]), group=self.group)]
        if len(lanes) > BLOCK // 4:
            # After the first block on every rank: independent, MLX could run it first.
            rest = mx.depends(mx.array(lanes[BLOCK // 4 :]), arrays[0])
            arrays.append(mx.distributed.all_sum(rest, group=self.group))
        if wait:
            mx.eval(arrays)
        else:
            mx.async_eval(arrays)
        self._queued = arrays

    def recv(self) -> Any:
        head = mx.distributed.all_sum(mx.zeros(BLOCK // 4, mx.int32), group=self.group)
        raw = np.array(head).tobytes()
        n = int.from_bytes(raw[:8], "little")
        if n + 8 > BLOCK:
            more = (n + 8 - BLOCK + 3) // 4
            rest = mx.distributed.all_sum(mx.zeros(more, mx.int32), group=self.group)
            raw += np.array(rest).tobytes()
        return pickle.loads(raw[8 : 8 + n])


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    holds: str
    weight_mib: float
    link_port: int = 0  # rank 0's liveness port (distributed/liveness.py); 0: none


def exchange_info(group: Any, mine: RankInfo) -> list[RankInfo]:
    """Every rank's record, on every rank (one all-gather at start-up)."""
    data = pickle.dumps(mine)
    assert len(data) <= INFO_BYTES - 4
    raw = len(data).to_bytes(4, "little") + data
    raw += bytes(INFO_BYTES - len(raw))
    lanes = mx.array(np.frombuffer(raw, np.int32))
    every = np.array(mx.distributed.all_gather(lanes, group=group)).tobytes()
    out = []
    for r in range(group.size()):
        row = every[r * INFO_BYTES : (r + 1) * INFO_BYTES]
        n = int.from_bytes(row[:4], "little")
        out.append(pickle.loads(row[4 : 4 + n]))
    return out
