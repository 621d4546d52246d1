"""Everything asked of the engine, as one record each: the engine's inbox holds them
(`Engine.post`, engine/engine.py), and the pipe to an engine in a child process carries the same
records (transport/process.py, transport/child.py). Frozen and picklable, with no futures inside:
whoever posts one gets a future beside it, answered with the command's answer type, the
parameter of `Command`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from omlx_logprobs.control import (
    AdapterChange,
    Control,
    ControlResult,
    WeightUpdate,
    WeightUpdateResult,
    WeightVersion,
)
from omlx_logprobs.training.calls import TrainAnswer, TrainCall
from omlx_logprobs.types import EngineRequest

A = TypeVar("A")


class Command(Generic[A]):
    """A command answered with an `A`; `answered` False: there is nothing to answer (A is None)
    and the future is done once the command is posted."""

    answered: ClassVar[bool] = True

    def refused(self, why: str, weights: WeightVersion) -> A:
        """The answer when the engine that held the command is gone (`weights`: the version it
        served)."""
        raise NotImplementedError


class Notice(Command[None]):
    """A command with nothing to answer."""

    answered = False

    def refused(self, why: str, weights: WeightVersion) -> None:
        return None


@dataclass(frozen=True)
class Submit(Notice):
    request: EngineRequest


@dataclass(frozen=True)
class Abort(Notice):
    """End every unfinished choice of the request (an unknown or finished id: nothing)."""

    request_id: str


@dataclass(frozen=True)
class BeginShutdown(Notice):
    """In-flight requests may finish for `grace_s` seconds; then they end with an error."""

    grace_s: float


@dataclass(frozen=True)
class Stop(Notice):
    """End the engine's loop (what memory keeps of the prefix cache goes to its disk tier)."""


@dataclass(frozen=True)
class UpdateWeights(Command[WeightUpdateResult]):
    """New weights once the requests in flight have finished (or been aborted, as the update
    asks); the answer says which version serves from then on."""

    update: WeightUpdate

    def refused(self, why: str, weights: WeightVersion) -> WeightUpdateResult:
        return WeightUpdateResult(weights, why)


@dataclass(frozen=True)
class ChangeAdapter(Command[str | None]):
    """Load, replace or unload a LoRA adapter between two steps; the answer is None, or why
    nothing changed."""

    change: AdapterChange

    def refused(self, why: str, weights: WeightVersion) -> str | None:
        return why


@dataclass(frozen=True)
class ControlCommand(Command[ControlResult]):
    """Pause, resume, flush, sleep or wake between two steps (docs/specs/rl.md); a pause that
    waits for its requests is answered when they have finished, a sleep once nothing runs."""

    control: Control

    def refused(self, why: str, weights: WeightVersion) -> ControlResult:
        return ControlResult(False, error=why)


@dataclass(frozen=True)
class Train(Command[TrainAnswer]):
    """One training call (training/calls.py), done on the engine's thread between two steps:
    serving goes on between calls, each of which is bounded (one datum's forward and backward,
    one optimizer step)."""

    call: TrainCall

    def refused(self, why: str, weights: WeightVersion) -> TrainAnswer:
        return TrainAnswer(error=why, user=False)


_POSTED: Future[Any] = Future()
_POSTED.set_result(None)


def posted() -> Future[Any]:
    """The future of a command with nothing to answer: done already (one for all of them; a
    done future keeps no callbacks)."""
    return _POSTED
