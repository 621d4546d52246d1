"""What crosses between the server and the engine child (transport/process.py): the spec the
child is started with, the messages the parent sends besides the `EngineRequest`s themselves,
and the child's answers."""

from __future__ import annotations

from dataclasses import dataclass

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.types import (
    INITIAL_WEIGHTS,
    AdapterChange,
    Control,
    ControlResult,
    RequestOutput,
    WeightUpdate,
    WeightUpdateResult,
    WeightVersion,
)

NO_STATS = EngineStats(0, 0, 0, False, 0, 0, 0, 0)


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


# ---- messages (a parent sends `EngineRequest`s as they are) --------------------------------------
@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class BeginShutdown:
    grace_s: float


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class UpdateWeights:
    uid: int
    update: WeightUpdate


@dataclass(frozen=True)
class WeightsUpdated:
    uid: int
    result: WeightUpdateResult


@dataclass(frozen=True)
class ChangeAdapter:
    uid: int
    change: AdapterChange


@dataclass(frozen=True)
class AdapterChanged:
    uid: int
    error: str | None


@dataclass(frozen=True)
class ControlCommand:
    uid: int
    command: Control


@dataclass(frozen=True)
class Controlled:
    uid: int
    result: ControlResult


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
