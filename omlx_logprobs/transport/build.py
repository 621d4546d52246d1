"""The engine built from its spec: the one place a model is loaded for an engine, whichever
transport runs it (a thread of the server's process: cli.start_engine; the engine's child:
transport/child.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omlx_logprobs.engine.engine import Engine, Sink
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner.model_runner import ModelRunner
from omlx_logprobs.runner.weights import load_into
from omlx_logprobs.transport.messages import EngineSpec


def build_engine(
    spec: EngineSpec, sink: Sink | None = None, on_hang: Callable[[str], None] | None = None
) -> tuple[LoadedModel, Engine]:
    """The model the spec names (rank 0's share, when it is split over the processes of
    `mlx.launch`) with the weights last loaded in place, and its engine, not yet started.
    `spec.model` is already resolved (a directory or a scripted model: cli.start_engine).
    `on_hang`: what ends the process when a group's watchdog fires (distributed/distributed.py)."""
    runner: Any = ModelRunner
    if spec.engine.parallel is not None:  # rank 0 of a group started by mlx.launch
        from omlx_logprobs.distributed.distributed import leader_parts

        model, runner = leader_parts(spec.model, spec.name, spec.engine, on_hang)
    else:
        model = load_model(
            spec.model, spec.name, spec.engine.max_model_len, dtype=spec.engine.dtype
        )
    if spec.weights_path is not None:
        load_into(model.model, spec.weights_path)
    engine = Engine(
        model.model,
        model.vocab,
        model.eos_token_ids,
        spec.engine,
        sink,
        spec.weights,
        tokenizer=model.tokenizer,
        runner=runner,
        adapters=spec.adapters,
        context=model.max_model_len,
    )
    return model, engine
