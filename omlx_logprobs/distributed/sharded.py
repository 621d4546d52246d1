"""A model's share for one process of a distributed group (`mlx.launch`): its weights split
over the group, tensor parallel (`model.shard(group)`, the family's own mlx-lm code: every
layer's attention heads and MLP columns split, an all-sum after each) or pipeline parallel
(consecutive layers per process, hidden states sent from one to the next: mlx-lm's
`model.model.pipeline(group)` where the family has it, else the runner's own layer ranges,
distributed/layer_pipeline.py). `--tensor-parallel` or `--pipeline-parallel` picks one where a
family has both.

A tensor split must divide every dimension it cuts (distributed/shard_check.py); where the group
size does not divide one (SmolLM2's 9 heads over 2 processes), the layers are split instead,
unless `--tensor-parallel` was asked for: then, as for a family with neither split, start-up is
refused with the reason (`SplitRefused`), on every rank and before any request.

The weights are read lazily and only the share is evaluated, so no process holds the whole
model. Everything else about loading (the tokenizer, the vocabulary, the served name) is the
one-process loader's (models/loader.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

from omlx_logprobs.distributed import layer_pipeline, shard_check
from omlx_logprobs.models.dtype import apply_dtype

log = logging.getLogger("omlx_logprobs")

PARALLEL_MODES = ("auto", "tensor", "pipeline")


class SplitRefused(RuntimeError):
    """The model cannot be split over this group as asked (said at start-up on every rank)."""


@dataclass(frozen=True)
class Share:
    net: Any  # the mlx-lm module, holding this process's share only
    mode: str  # "tensor" or "pipeline"
    holds: str  # what this process holds, for the start-up log and /health
    weight_bytes: int


def supported_modes(net: Any) -> list[str]:
    modes = []
    if hasattr(net, "shard"):
        modes.append("tensor")
    mlx_lms = hasattr(net, "model") and hasattr(net.model, "pipeline")
    if mlx_lms or layer_pipeline.eligible(net):
        modes.append("pipeline")
    return modes


def choose_mode(net: Any, asked: str) -> str:
    """Tensor parallel where the family has it and nothing else is asked (every process works
    on every token, one all-sum per layer half), else pipeline; SplitRefused when the family
    has neither, or not the one asked for."""
    have = supported_modes(net)
    family = layer_pipeline.family(net)
    if not have:
        raise SplitRefused(
            f"mlx-lm's {family} family can be split over processes neither by tensor nor by"
            " pipeline parallelism; serve it on one machine"
        )
    if asked == "auto":
        return have[0]
    if asked not in have:
        raise SplitRefused(
            f"mlx-lm's {family} family has no {asked} parallelism (it has: {', '.join(have)})"
        )
    return asked


def load_share(path: Path, group: Any, asked: str = "auto", dtype: str = "auto") -> Share:
    """This process's share of the mlx-lm model in `path`, cast as `--dtype` asks; SplitRefused
    when it cannot be split over `group` as asked."""
    net = _lazy(path)
    mode = choose_mode(net, asked)
    n = group.size()
    if mode == "tensor":
        why = shard_check.shard(net, group)
        if why is not None:
            mode = _instead(net, asked, why)
            net = _lazy(path)  # the refused split left it half cut
    if mode == "tensor":
        holds = f"1/{n} of every layer's attention heads and MLP (tensor parallel)"
    else:
        holds = _pipeline(net, group)
    done = apply_dtype(net, dtype)
    mx.eval(net.parameters())
    weight_bytes = sum(v.nbytes for v in dict(tree_flatten(net.parameters())).values())
    log.info("weights: %s; this process holds %s", done, holds)
    return Share(net, mode, holds, weight_bytes)


def _lazy(path: Path) -> Any:
    net, _ = mlx_lm_load_model(path, lazy=True, strict=False)
    return net


def _instead(net: Any, asked: str, why: str) -> str:
    """The split to make when tensor parallelism cannot divide the model (`why`): the layers,
    unless the tensor split was asked for or the family has no other."""
    other = "pipeline" in supported_modes(net)
    if asked == "auto" and other:
        log.warning("%s: splitting the layers over the ranks instead (pipeline parallel)", why)
        return "pipeline"
    if other:
        raise SplitRefused(f"{why}; --pipeline-parallel splits the layers instead")
    raise SplitRefused(
        f"{why}, and mlx-lm's {layer_pipeline.family(net)} family cannot be split by layers"
        " here: run it on a number of processes that divides them"
    )


def _pipeline(net: Any, group: Any) -> str:
    """Split `net`'s layers over `group` (mlx-lm's pipeline, else the runner's own ranges);
    what this process holds."""
    n, total = group.size(), len(net.model.layers)
    if total < n:
        raise SplitRefused(
            f"pipeline parallel over {n} ranks needs num_hidden_layers ({total}) of at least {n}"
        )
    if hasattr(net.model, "pipeline"):
        net.model.pipeline(group)
        start, end = net.model.start_idx, net.model.end_idx
    else:
        start, end = layer_pipeline.split(net, group)
    return f"layers {start}-{end - 1} of {total} (pipeline parallel)"
