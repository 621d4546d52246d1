"""A model's share for one process of a distributed group (`mlx.launch`): its weights split
over the group by the family's own mlx-lm code, tensor parallel (`model.shard(group)`: every
layer's attention heads and MLP columns split, an all-sum after each) or pipeline parallel
(`model.model.pipeline(group)`: consecutive layers per process, hidden states sent from one to
the next). Which a family has is mlx-lm's to say (its `shard` method, its model's `pipeline`);
`--tensor-parallel` or `--pipeline-parallel` picks one where a family has both.

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

from omlx_logprobs.models.dtype import apply_dtype

log = logging.getLogger("omlx_logprobs")

PARALLEL_MODES = ("auto", "tensor", "pipeline")


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
    if hasattr(net, "model") and hasattr(net.model, "pipeline"):
        modes.append("pipeline")
    return modes


def choose_mode(net: Any, asked: str) -> str:
    """Tensor parallel where the family has it and nothing else is asked (every process works
    on every token, one all-sum per layer half), else pipeline; ValueError when the family has
    neither, or not the one asked for."""
    have = supported_modes(net)
    family = type(net).__module__.rsplit(".", 1)[-1]
    if not have:
        raise ValueError(
            f"mlx-lm's {family} family can be split over processes neither by tensor nor by"
            " pipeline parallelism; serve it on one machine"
        )
    if asked == "auto":
        return have[0]
    if asked not in have:
        raise ValueError(
            f"mlx-lm's {family} family has no {asked} parallelism (it has: {', '.join(have)})"
        )
    return asked


def load_share(path: Path, group: Any, asked: str = "auto", dtype: str = "auto") -> Share:
    """This process's share of the mlx-lm model in `path`, cast as `--dtype` asks."""
    net, _ = mlx_lm_load_model(path, lazy=True, strict=False)
    mode = choose_mode(net, asked)
    n = group.size()
    if mode == "tensor":
        try:
            net.shard(group)
        except Exception as exc:  # a head count the group size does not divide, mostly
            raise ValueError(f"the model cannot be split over {n} processes: {exc}") from exc
        holds = f"1/{n} of every layer's attention heads and MLP (tensor parallel)"
    else:
        total = len(net.model.layers)
        net.model.pipeline(group)
        start, end = net.model.start_idx, net.model.end_idx
        holds = f"layers {start}-{end - 1} of {total} (pipeline parallel)"
    done = apply_dtype(net, dtype)
    mx.eval(net.parameters())
    weight_bytes = sum(v.nbytes for v in dict(tree_flatten(net.parameters())).values())
    log.info("weights: %s; this process holds %s", done, holds)
    return Share(net, mode, holds, weight_bytes)
