"""What the engine's inbox holds: one record for each thing asked of the engine from another
thread, taken by the engine thread between two steps (engine/engine.py, `_drain_inbox`). Those
that are answered carry the future their answer is set on."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from omlx_logprobs.types import (
    AdapterChange,
    Control,
    ControlResult,
    EngineRequest,
    WeightUpdate,
    WeightUpdateResult,
)


@dataclass(frozen=True)
class Submit:
    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    """End every unfinished choice of the request (an unknown or finished id: nothing)."""

    request_id: str


@dataclass
class PendingUpdate:
    """New weights, once the requests in flight have finished (or been aborted)."""

    update: WeightUpdate
    done: Future[WeightUpdateResult]
    asked: float  # monotonic time of the request
    aborted: int = 0  # requests it aborted


@dataclass(frozen=True)
class PendingAdapter:
    """Load, replace or unload a LoRA adapter; the answer is None, or why nothing changed."""

    change: AdapterChange
    done: Future[str | None]


@dataclass(frozen=True)
class PendingControl:
    """Pause, resume or flush (docs/specs/rl.md)."""

    command: Control
    done: Future[ControlResult]


Command = Submit | Abort | PendingUpdate | PendingAdapter | PendingControl
