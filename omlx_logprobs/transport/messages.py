"""What crosses between the server and the engine child (transport/process.py) besides the
commands themselves (engine/commands.py, sent as `(uid, command)`, uid 0 when nothing is to
be answered): the spec the child is started with, and the child's messages back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import INITIAL_WEIGHTS, WeightVersion
from omlx_logprobs.engine.commands import Command
from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.types import RequestOutput

NO_STATS = EngineStats(0, 0, 0, False, 0, 0, 0, 0)

Posted = tuple[int, Command[Any]]  # the parent's message: a command and the uid of its answer


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to load the model and build its engine."""

    model: str | None
    name: str | None
    engine: EngineConfig
    log_level: str = "info"
    # The last weights loaded in place (POST /update_weights_from_disk): a restarted child
    # serves them, under the same version, not the ones --model names.
    weights_path: str | None = None
    weights: WeightVersion = INITIAL_WEIGHTS
    # LoRA adapters (name, path) loaded at start and since: a restarted child loads them too.
    adapters: tuple[tuple[str, str], ...] = ()


# ---- the child's messages ------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """The answer to the command posted under `uid`."""

    uid: int
    result: Any


@dataclass(frozen=True)
class Ready:
    vocab_size: int


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Fault:
    """The child cannot go on and is about to exit; the message says why (a model split over
    processes whose group is lost: distributed/distributed.py)."""

    message: str


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]
    stats: EngineStats
