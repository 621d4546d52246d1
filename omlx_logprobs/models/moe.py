"""The routing shape of a mixture-of-experts model, read from its config.json: how many MoE
layers, how many experts each token is routed to and out of how many. What the API checks a
request's routed experts against (runner/routing.py records and replays them); None for a model
whose routing the server does not record (a dense model, a family runner/routing.py does not
know)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RoutingShape", "routing_shape"]


@dataclass(frozen=True)
class RoutingShape:
    layers: int  # MoE layers, in order (the dense ones are not counted)
    top_k: int
    experts: int


def routing_shape(where: str | Path) -> RoutingShape | None:
    """The model directory's routing shape, for the families runner/routing.py records (a
    str from the API, which opens no paths itself: tests/reliability/test_security.py)."""
    path = Path(where)
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    c = json.loads(config.read_text())
    kind = c.get("model_type")
    try:
        n = int(c["num_hidden_layers"])
        top_k = int(c["num_experts_per_tok"])
        if kind == "qwen3_moe":
            experts, step = int(c["num_experts"]), int(c.get("decoder_sparse_step", 1))
            dense = set(c.get("mlp_only_layers") or [])
            moe = [i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0]
            layers = len(moe)
        elif kind == "qwen2_moe":
            experts, layers = int(c["num_experts"]), n
        elif kind == "mixtral":
            experts, layers = int(c["num_local_experts"]), n
        else:
            return None
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return RoutingShape(layers, top_k, experts) if layers else None
