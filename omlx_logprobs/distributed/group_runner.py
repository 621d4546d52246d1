"""The model runners of a model split over processes (distributed/distributed.py has the reasoning):
rank 0's (`LeaderRunner`: sends each step's work to the other ranks before running it, samples,
and watches the group) and the other ranks' (`FollowerRunner`, and `follow`, which rebuilds
each of rank 0's steps and runs the same forwards)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.batch.scheduler import PrefillChunk, SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.distributed.group import Channel, GroupLost
from omlx_logprobs.distributed.group_model import GroupModel
from omlx_logprobs.engine.stats import GroupHealth, RankHealth
from omlx_logprobs.runner.model_runner import ModelRunner
from omlx_logprobs.runner.step import LaunchedStep, StepResult
from omlx_logprobs.runner.weights import WeightsError

log = logging.getLogger("omlx_logprobs")

PING_S = 1.0  # an idle rank 0 checks the group this often
WATCH_S = 0.5  # the watchdog's period


class _GroupRunner(ModelRunner):
    group: Any
    # A compiled trace of a forward with collectives in it was never run on a group.
    compiles = False
    # Routed experts are recorded by one process alone (the followers hold no replay).
    routes = False

    def _forward_unread(
        self, ids: mx.array, cache: list[Any], **extra: Any
    ) -> tuple[mx.array, ...]:
        # A forward is a collective: its output must run on every rank, or a pipeline's
        # first stage never sends and its last waits for ever. The body's output is enough
        # (the head is the same on every rank and reads nothing from the others).
        if self.plan.split is not None:
            return (self.plan.split.body(ids, cache=cache, **extra),)
        return (self.model(ids, cache=cache, **extra),)

    def warm_attention(self, chunk: int, context: int) -> None:
        """Not on a group: its probe forward would be a collective the other ranks never run."""


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
        # No prefix cache: every rank would keep different prefixes (see
        # distributed/distributed.py's docstring).
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
            forks = [f.seq_id for f in s.forks]
            # an embedding prompt prefills in groups of its own: every rank groups it alike
            new = (np.asarray(s.context_ids, np.int32), s.params, forks, s.embed)
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

    def sleep(self, level: int) -> None:
        if level >= 2:  # each process holds its own share: they would all have to drop theirs
            raise WeightsError(
                "sleep level 2 cannot drop the weights while the model is split over processes;"
                " level 1 releases the caches"
            )
        super().sleep(level)

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
        """A liveness link broke (distributed/liveness.py): a step in flight may never complete, so
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
        self.batch.sampled(tokens, seqs)
        self.queue(tokens)
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
            if not runner.batch.rows and not seqs:
                runner.idle()
            continue
        decode_n, chunks = msg[1]
        prefill = []
        for lid, start, end, new, joining in chunks:
            if new is not None:
                prompt, params, forks, embed = new
                seq = Sequence("", prompt.tolist(), params)
                seq.embed = embed
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
        rows = runner.batch.rows
        if len(rows) != decode_n:
            raise RuntimeError(
                f"rank {runner.group.rank()} holds {len(rows)} batch rows, rank 0"
                f" {decode_n}: the ranks drifted apart"
            )
        runner.launch(SchedulerOutput(decode=list(rows), prefill=prefill))
        steps += 1
