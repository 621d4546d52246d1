"""Loading a model for a group (distributed/distributed.py has the whole design): join the group,
load this rank's share of the weights (distributed/sharded.py), order its forwards the same way on
every rank, and learn every rank's share; what every rank's runner is built with."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.distributed.group import RankInfo, exchange_info, init_group
from omlx_logprobs.distributed.liveness import Listener, rank0_address
from omlx_logprobs.distributed.sharded import Share, SplitRefused, load_share
from omlx_logprobs.models.loader import LoadedModel, load_model, logits_width
from omlx_logprobs.vocab import build_vocabulary

log = logging.getLogger("omlx_logprobs")


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
    rank 0's server the same way on every rank), and learn every rank's share. SplitRefused
    (said in the log first) when the model cannot be split over the group as asked."""
    group, backend = init_group()
    facts = load_model(source, name, cfg.max_model_len, weights=False)
    try:
        share = load_share(Path(facts.path), group, cfg.parallel or "auto", cfg.dtype)
    except SplitRefused as exc:
        # Every rank reaches the same verdict. Each says it, then waits for the others to have
        # said it: mlx.launch stops every rank once one exits with an error, which would cut a
        # slower rank short of its message (rank 0's engine starts last).
        log.error("the model cannot be split as asked: %s", exc)
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))
        raise
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
