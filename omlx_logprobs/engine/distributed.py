"""One model split over several processes (several Macs, several GPUs) started by `mlx.launch`,
through MLX's own distributed backend (ring, JACCL, MPI, NCCL).

Rank 0 is the server: HTTP, tokenization, the scheduler, sampling, logprob extraction and the
answers, exactly as with one process. Every rank holds a share of the weights
(models/sharded.py) and runs the same forwards on the same shapes, because each forward of a
split model is itself a collective (an all-sum per layer half when tensor parallel, a send from
each stage to the next when pipeline parallel).

Why rank 0 sends the model runner's work and not the engine's inputs: the engine's decisions
depend on time (the prefill delay, when an abort or a request lands, when a step is processed
beside the next), so followers replaying the engine on the same requests would drift apart.
The runner's calls are the decisions already made: which prompt chunks prefill in which step,
which rows join and leave the batch. So rank 0's runner (`LeaderRunner`) sends, once per step
and before queueing the step, one command holding that step's prefill chunks (a new prompt's
ids and parameters the first time it appears) and the batch changes since the last step; a
follower (`follow`) rebuilds the same `SchedulerOutput` over its own `Sequence` records and
calls the same `ModelRunner.launch`, so both build the same graph.

Followers never sample: rank 0 samples (penalties, grammars, seeds: all its own state) and
all-sums its sampled ids with zeros from the others inside the step's graph, so every rank's
next decode step reads the same ids on its device with no host round trip, and rank 0 keeps
processing one step beside the next launch on a GPU. The follower's zeros depend on its logits
(`mx.depends`) so that the ids' all-sum comes after the forward's collectives on every rank.

MLX has no broadcast: a command is pickled into a fixed 4 KiB uint8 block (its length first;
a second block for the rest when longer), all-summed with zeros from the others. Rank 0 only
queues it (`async_eval`), so it never waits for the followers to read it; a follower evaluates
it, which also orders its step after its last one.

Faults: a collective with a dead peer may raise on rank 0 (the ring backend: "connection to a
peer was lost"), but a step's graph holds many, and when one fails the array rank 0 waits on
may never complete. So each follower also keeps a TCP link to rank 0 (engine/liveness.py): a
link that closes or falls silent marks the group lost at once, and a watchdog thread ends rank
0's engine process when a thread is inside the group then (it would never come back), or when
one call into the group has waited `group_timeout_s` (a rank alive but stuck). Either way the
requests in flight end with an error naming the group, /health answers 503, and later requests
fail at once: a group cannot be re-formed without restarting every rank. While idle, rank 0
sends a ping every second. A clean stop of rank 0 sends "stop" and every follower exits.

Not supported split: prefix caching (each rank's budget would hold its own share's bytes and
drop different prefixes), weight updates in place, and several models in one server.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.liveness import Listener, keep_alive, rank0_address
from omlx_logprobs.engine.model_runner import ModelRunner
from omlx_logprobs.engine.scheduler import PrefillChunk, SchedulerOutput
from omlx_logprobs.engine.sequence import Sequence, Status
from omlx_logprobs.engine.stats import GroupHealth, RankHealth
from omlx_logprobs.engine.step import LaunchedStep, StepResult
from omlx_logprobs.engine.weights import WeightsError
from omlx_logprobs.models.loader import LoadedModel, load_model, logits_width
from omlx_logprobs.models.sharded import Share, load_share
from omlx_logprobs.vocab import build_vocabulary

log = logging.getLogger("omlx_logprobs")

BLOCK = 4096  # bytes of a command's first all-sum: its length and most commands whole
INFO_BYTES = 1024  # each rank's start-up record
PING_S = 1.0  # an idle rank 0 checks the group this often
WATCH_S = 0.5  # the watchdog's period
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
    """Rank 0 to every other rank: a pickled object as all-sums (see the docstring). The bytes
    travel as int32 lanes, a type every backend sums (NCCL, MPI, ring, JACCL)."""

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
    link_port: int = 0  # rank 0's liveness port (engine/liveness.py); 0: none


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


# ---- loading -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupModel:
    """This rank's share of the model, and what rank 0 needs to serve it."""

    model: LoadedModel
    share: Share
    group: Any
    backend: str
    ranks: list[RankInfo]
    listener: Listener | None = None  # rank 0's end of the liveness links


def load_for_group(source: str, name: str | None, cfg: EngineConfig) -> GroupModel:
    """Join the group, load this rank's share of `source` (an mlx-lm directory, resolved by
    rank 0's server the same way on every rank), and learn every rank's share."""
    group, backend = init_group()
    facts = load_model(source, name, cfg.max_model_len, weights=False)
    share = load_share(Path(facts.path), group, cfg.parallel or "auto", cfg.dtype)
    order_forwards(share.net, share.mode)
    vocab = build_vocabulary(facts.tokenizer, max(logits_width(share.net), len(facts.tokenizer)))
    model = replace(facts, model=share.net, vocab=vocab)
    listener = _listen() if group.rank() == 0 else None
    mine = RankInfo(
        group.rank(),
        socket.gethostname(),
        share.holds,
        share.weight_bytes / 2**20,
        listener.port if listener is not None else 0,
    )
    ranks = exchange_info(group, mine)
    if group.rank() == 0:
        log.info(
            "distributed: %d processes over the %s backend, %s parallel",
            group.size(),
            backend,
            share.mode,
        )
        for r in ranks:
            log.info(
                "rank %d on %s holds %s: %.1f MiB of weights", r.rank, r.host, r.holds, r.weight_mib
            )
    return GroupModel(model, share, group, backend, ranks, listener)


def _listen() -> Listener | None:
    address = rank0_address()
    if address is None:
        log.info("no liveness link (rank 0's address unknown): a lost rank is seen by timeout")
        return None
    try:
        return Listener(address)
    except OSError as exc:
        log.warning("no liveness link on %s (%s): a lost rank is seen by timeout", address, exc)
        return None


def order_forwards(net: Any, mode: str) -> None:
    """Make each forward of `net` run after the one before it on every rank. One evaluation
    may hold several forwards (a step's prefill groups and decode rows, the start-up probe),
    and MLX may run independent branches of a graph in any order; two ranks that took their
    forwards' collectives in different orders would wait on each other for ever.

    Tensor parallel, every rank's graph is the same, and each forward's first all-sum reads the
    token ids: the ids are made to depend on a scalar of the last forward's output. Pipeline
    parallel, the last stage's first collective is a receive that reads nothing of this rank's
    graph, so no link can order it: each forward is evaluated when it is called (a host wait
    per forward, which a pipeline has anyway: each stage waits for the one before it)."""
    body = net.model if hasattr(net, "model") else net
    cls = type(body)
    # The link and the thread that made it: a graph cannot use another thread's arrays that
    # are not evaluated (MLX streams are per thread), and the engine's forwards are all on its
    # thread; the start-up probe's, on the thread that loads, were evaluated where they ran.
    last: list[tuple[mx.array, int] | None] = [None]

    def chained(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        here = threading.get_ident()
        if last[0] is not None and last[0][1] == here:
            inputs = mx.depends(inputs, last[0][0])
        out = cls.__call__(self, inputs, *args, **kwargs)
        last[0] = (mx.sum(out.reshape(-1)[-1:]), here)
        return out

    def evaluated(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = cls.__call__(self, inputs, *args, **kwargs)
        mx.eval(out)
        return out

    call = chained if mode == "tensor" else evaluated
    body.__class__ = type(cls.__name__, (cls,), {"__call__": call})


def runner_args(cfg: EngineConfig) -> dict[str, Any]:
    """What every rank's runner is built with besides the model (the same on each rank)."""
    return {"cache_limit_mib": cfg.cache_limit_mib, "prefix_cache_mib": 0}


# ---- the runners ---------------------------------------------------------------------------------
class _GroupRunner(ModelRunner):
    group: Any
    # A compiled trace of a forward with collectives in it was never run on a group.
    compiles = False

    def _forward_unread(self, ids: mx.array, cache: list[Any]) -> tuple[mx.array, ...]:
        # A forward is a collective: its output must run on every rank, or a pipeline's
        # first stage never sends and its last waits for ever. The body's output is enough
        # (the head is the same on every rank and reads nothing from the others).
        if self.split is not None:
            return (self.split.body(ids, cache=cache),)
        return (self.model(ids, cache=cache),)


class LeaderRunner(_GroupRunner):
    """Rank 0's runner: sends each step's work to the other ranks, then runs it itself."""

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        cache_limit_mib: int | None = None,
        prefix_cache_mib: int = 0,
        stop_ids: tuple[int, ...] = (),
        *,
        gm: GroupModel,
        timeout_s: float,
        on_hang: Callable[[str], None] | None = None,
    ) -> None:
        # No prefix cache: every rank would keep different prefixes (see the docstring).
        super().__init__(model, vocab_size, cache_limit_mib, 0, stop_ids)
        self.group = gm.group
        self.gm = gm
        self.channel = Channel(gm.group)
        self.timeout_s = timeout_s
        self.on_hang = on_hang  # the process cannot get its engine thread back: ends it
        self.fault: str | None = None
        self._ops: list[tuple[str, list[int]]] = []  # batch changes for the next command
        self._known: set[int] = set()  # seq ids the followers hold a record of
        self._sent_at = time.monotonic()
        # (since, what) by thread, while inside the group: on a GPU a step is read on a second
        # thread while the engine thread queues the next.
        self._busy: dict[int, tuple[float, str]] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="omlx-group-watchdog", daemon=True).start()
        if gm.listener is not None:
            gm.listener.start({r.rank: r.host for r in gm.ranks[1:]}, self._peer_lost)

    # ---- the step -----------------------------------------------------------------------------
    def launch(self, work: SchedulerOutput) -> LaunchedStep | None:
        self._check()
        plan = (len(work.decode), [self._chunk(c) for c in work.prefill])
        # Any failure once the command is out leaves the other ranks a step this one did not
        # finish: the ranks no longer agree, so the group is lost whatever the error.
        with self._inside("a step", fatal=True):
            self._send(("step", plan))
            return super().launch(work)

    def collect(self, step: LaunchedStep) -> StepResult:
        with self._inside("a step's results"):
            return super().collect(step)

    def _shared(self, tokens: mx.array) -> mx.array:
        return mx.distributed.all_sum(tokens.astype(mx.int32), group=self.group)

    def _chunk(self, c: PrefillChunk) -> tuple[Any, ...]:
        s = c.seq
        new = None
        if s.seq_id not in self._known:  # its first chunk: what the followers need of it
            new = (np.asarray(s.prompt_ids, np.int32), s.params, [f.seq_id for f in s.forks])
            self._known.update(m.seq_id for m in s.group)
        joining = [m.seq_id for m in s.joining()] if c.is_last else None
        return (s.seq_id, c.start, c.end, new, joining)

    def admit(self, seqs: list[Sequence]) -> None:
        self._ops.append(("admit", [s.seq_id for s in seqs]))
        super().admit(seqs)

    def release(self, seqs: list[Sequence]) -> None:
        gone = [s.seq_id for s in seqs if s.seq_id in self._known]
        if gone:
            self._ops.append(("release", gone))
            self._known.difference_update(gone)
        super().release(seqs)

    def load_weights(self, path: str) -> None:
        raise WeightsError(
            "weights cannot be replaced in place while the model is split over processes;"
            " restart the group with the new weights"
        )

    # ---- idle and stop ------------------------------------------------------------------------
    def heartbeat(self) -> None:
        if self.fault is not None or time.monotonic() - self._sent_at < PING_S:
            return
        try:
            with self._inside("a heartbeat"):
                self._send(("ping",), wait=True)
        except GroupLost:
            pass  # said in the log and on /health; the next request fails at once

    def close(self) -> None:
        self._closed.set()  # the followers' links close after "stop": no fault
        if self.fault is None:
            try:
                with self._inside("the stop"):
                    self._send(("stop",), wait=True)
            except GroupLost:
                pass
        if self.gm.listener is not None:  # the followers exit: their links close
            self.gm.listener.join(5.0)

    def health(self) -> GroupHealth:
        state = "ok" if self.fault is None else "lost"
        ranks = tuple(
            RankHealth(r.rank, r.host, r.holds, round(r.weight_mib, 1), state if r.rank else "ok")
            for r in self.gm.ranks
        )
        return GroupHealth(
            self.group.size(), self.gm.backend, self.gm.share.mode, state, self.fault, ranks
        )

    # ---- faults -------------------------------------------------------------------------------
    def _send(self, kind: tuple[Any, ...], wait: bool = False) -> None:
        ops, self._ops = self._ops, []
        self.channel.send((*kind, ops), wait)
        self._sent_at = time.monotonic()

    def _check(self) -> None:
        if self.fault is not None:
            raise GroupLost(self._message())

    def _message(self) -> str:
        return (
            f"the model's distributed group is lost ({self.fault}); every rank must be"
            " restarted (mlx.launch)"
        )

    @contextmanager
    def _inside(self, what: str, fatal: bool = False) -> Iterator[None]:
        me = threading.get_ident()
        self._busy[me] = (time.monotonic(), what)
        try:
            yield
        except GroupLost:
            raise
        except Exception as exc:
            if not (fatal or _is_group_error(exc)):
                raise
            self._lose(f"{what} failed: {exc}")
            raise GroupLost(self._message()) from exc
        finally:
            self._busy.pop(me, None)

    def _lose(self, why: str) -> None:
        if self.fault is None:
            self.fault = why
            log.error("distributed group lost: %s", why)

    def _peer_lost(self, why: str) -> None:
        """A liveness link broke (engine/liveness.py): a step in flight may never complete, so
        the watchdog ends this process if a thread is inside the group."""
        if not self._closed.is_set():
            self._lose(why)

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            waits = list(self._busy.values())
            if not waits:
                continue
            busy = min(waits)
            waited = time.monotonic() - busy[0]
            if self.fault is not None and waited > WATCH_S:  # inside a group known lost
                if self.on_hang is not None:
                    self.on_hang(self._message())
                return
            if waited > self.timeout_s:
                self._lose(
                    f"rank 0 waited {waited:.0f} s on the other ranks in {busy[1]}: a rank is"
                    " stuck or the network between them is down"
                )
                if self.on_hang is not None:
                    self.on_hang(self._message())
                return


def _is_group_error(exc: Exception) -> bool:
    # MLX raises RuntimeError for a backend's failures ("[ring] connection to a peer was
    # lost", NCCL's and MPI's errors); the engine's own bugs are other exceptions.
    return isinstance(exc, RuntimeError)


class FollowerRunner(_GroupRunner):
    """A rank other than 0: the same forwards; the sampled ids come from rank 0."""

    def __init__(self, *args: Any, group: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _sample(self, logits: mx.array, seqs: list[Sequence]) -> LaunchedStep:
        for s in seqs:
            s.num_sampled += 1
        zeros = mx.depends(mx.zeros((len(seqs),), mx.int32), logits)
        tokens = mx.distributed.all_sum(zeros, group=self.group)
        self.last_tokens = tokens
        self.last_seqs, self._last_rows = list(seqs), None
        self._queue(tokens)
        return LaunchedStep(seqs, None)


def follow(runner: FollowerRunner) -> None:
    """A follower's life after loading: run rank 0's commands until it says stop. Raises when
    the group breaks (rank 0 gone): the process then ends with an error."""
    channel = Channel(runner.group)
    seqs: dict[int, Sequence] = {}  # rank 0's seq id -> this rank's record
    ids: dict[int, int] = {}  # this rank's seq id -> rank 0's
    steps = 0
    while True:
        msg = channel.recv()
        kind, ops = msg[0], msg[-1]
        for op, which in ops:
            if op == "admit":
                members = [seqs[i] for i in which]
                runner.admit(members)
                for m in members:
                    m.status = Status.RUNNING
            else:
                gone = [seqs.pop(i) for i in which if i in seqs]
                for g in gone:
                    ids.pop(g.seq_id, None)
                runner.release(gone)
        if kind == "stop":
            log.info(
                "rank %d: stopped by rank 0 after %d steps, holding %d sequences",
                runner.group.rank(),
                steps,
                len(seqs),
            )
            return
        if kind == "ping":
            if not runner.rows and not seqs:
                runner.idle()
            continue
        decode_n, chunks = msg[1]
        prefill = []
        for lid, start, end, new, joining in chunks:
            if new is not None:
                prompt, params, forks = new
                seq = Sequence("", prompt.tolist(), params)
                seqs[lid], ids[seq.seq_id] = seq, lid
                for index, fid in enumerate(forks, 1):
                    fork = seq.fork(index)
                    seqs[fid], ids[fork.seq_id] = fork, fid
            seq = seqs[lid]
            if joining is not None:
                join = set(joining)
                for m in seq.group:
                    if m.status is Status.WAITING and ids[m.seq_id] not in join:
                        m.status = Status.FINISHED
            prefill.append(PrefillChunk(seq, start, end))
        if len(runner.rows) != decode_n:
            raise RuntimeError(
                f"rank {runner.group.rank()} holds {len(runner.rows)} batch rows, rank 0"
                f" {decode_n}: the ranks drifted apart"
            )
        runner.launch(SchedulerOutput(decode=list(runner.rows), prefill=prefill))
        steps += 1


# ---- the processes' entry points -----------------------------------------------------------------
def _end_process(message: str) -> None:
    log.critical("%s; the engine cannot go on", message)
    logging.shutdown()
    os._exit(3)


def leader_parts(
    source: str | None,
    name: str | None,
    cfg: EngineConfig,
    on_hang: Callable[[str], None] | None = None,
) -> tuple[LoadedModel, Callable[..., ModelRunner]]:
    """Rank 0's model and its engine's runner factory, in the process that runs the engine
    (the group belongs to the process whose thread runs its collectives). `on_hang`: what ends
    this process when the watchdog fires (default: log and exit)."""
    assert source is not None
    gm = load_for_group(source, name, cfg)
    factory = partial(
        LeaderRunner, gm=gm, timeout_s=cfg.group_timeout_s, on_hang=on_hang or _end_process
    )
    return gm.model, factory


def _rank0_lost(why: str) -> None:
    # After a clean stop rank 0 closes its end too: the main thread exits first (status 0).
    time.sleep(2.0)
    _end_process(f"rank 0's liveness link broke: {why}")


def follower_main(source: str, cfg: EngineConfig) -> int:
    """A rank other than 0: load its share, build the same runner as rank 0's, follow rank 0;
    the process's exit status."""
    gm = load_for_group(source, None, cfg)
    model = gm.model
    runner = FollowerRunner(
        model.model,
        len(model.vocab),
        stop_ids=tuple(model.eos_token_ids),
        group=gm.group,
        **runner_args(cfg),
    )
    address, port = rank0_address(), gm.ranks[0].link_port
    if address is not None and port:
        keep_alive(address, port, gm.group.rank(), _rank0_lost)
    log.info("rank %d ready: following rank 0", gm.group.rank())
    try:
        follow(runner)
    except Exception as exc:  # noqa: BLE001  (rank 0 gone, or the ranks drifted apart)
        log.error("rank %d stops: %s", gm.group.rank(), exc)
        return 1
    return 0
