"""One model split over several processes (several Macs, several GPUs) started by `mlx.launch`,
through MLX's own distributed backend (ring, JACCL, MPI, NCCL).

Rank 0 is the server: HTTP, tokenization, the scheduler, sampling, logprob extraction and the
answers, exactly as with one process. Every rank holds a share of the weights
(distributed/sharded.py) and runs the same forwards on the same shapes, because each forward of a
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
may never complete. So each follower also keeps a TCP link to rank 0 (distributed/liveness.py): a
link that closes or falls silent marks the group lost at once, and a watchdog thread ends rank
0's engine process when a thread is inside the group then (it would never come back), or when
one call into the group has waited `group_timeout_s` (a rank alive but stuck). Either way the
requests in flight end with an error naming the group, /health answers 503, and later requests
fail at once: a group cannot be re-formed without restarting every rank. While idle, rank 0
sends a ping every second. A clean stop of rank 0 sends "stop" and every follower exits.

Not supported split: prefix caching (each rank's budget would hold its own share's bytes and
drop different prefixes), weight updates in place, and several models in one server.

The parts: distributed/group.py (the launch environment, joining the group, the channel over
all-sums, every rank's record), distributed/group_model.py (loading this rank's share and ordering
its forwards), distributed/group_runner.py (rank 0's runner and the other ranks'); this module, the
processes' entry points (rank 0's model and runner factory, a follower's whole life).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.distributed.group_model import load_for_group, runner_args
from omlx_logprobs.distributed.group_runner import FollowerRunner, LeaderRunner, follow
from omlx_logprobs.distributed.liveness import keep_alive, rank0_address
from omlx_logprobs.distributed.sharded import SplitRefused
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner.model_runner import ModelRunner

log = logging.getLogger("omlx_logprobs")


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
    the process's exit status (2: the model cannot be split as asked, said in the log)."""
    try:
        gm = load_for_group(source, None, cfg)
    except SplitRefused:
        return 2
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
