"""The control plane's records: new weights and the version they make, LoRA adapters and theirs,
pauses and what each answers (docs/specs/rl.md). No mlx here: the API, the transport and the
engine all read these."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


@dataclass(frozen=True)
class AdapterChange:
    """Load a LoRA adapter (an mlx-lm adapter directory) under a name, replace the one of that
    name (`replace`: requests running on it finish on it), or unload one (`path` None)."""

    name: str
    path: str | None = None
    replace: bool = False


@dataclass(frozen=True)
class WeightVersion:
    """Which weights produced an output: a counter (0: the weights loaded at start, +1 at each
    update) and the tag the caller gave the update, if any."""

    counter: int = 0
    tag: str | None = None

    def json(self) -> dict[str, Any]:
        return {"counter": self.counter, "tag": self.tag}


INITIAL_WEIGHTS = WeightVersion()


@dataclass(frozen=True)
class AdapterVersion:
    """Which LoRA adapter produced an output: its name and the how-manieth load of that name
    (a name reloaded in place, prime-rl's way, is a new policy)."""

    name: str
    load: int

    def json(self) -> dict[str, Any]:
        return {"name": self.name, "load": self.load}


class PauseMode(str, Enum):
    """What a pause does with the requests in flight (vLLM's /pause modes, SGLang's
    /pause_generation ones; docs/specs/rl.md). New requests wait for the resume in every mode."""

    ABORT = "abort"  # they end at once, finish reason "abort", their tokens so far returned
    WAIT = "wait"  # they run to their end; the pause is answered once none is left
    KEEP = "keep"  # they stop where they are, keys and values kept (SGLang: in_place)
    RETRACT = "retract"  # they stop, their keys and values go; the resume prefills them again

    @property
    def halts(self) -> bool:
        """No step runs while paused: requests stay where they are."""
        return self in (PauseMode.KEEP, PauseMode.RETRACT)


@dataclass(frozen=True)
class Control:
    """A control-plane command for the engine, between two steps: pause (in a mode), resume,
    drop the kept prompt prefixes (`flush`), sleep (at a `level`) or wake (the weights read
    again from `path` if sleep dropped them)."""

    action: str  # "pause", "resume", "flush", "sleep", "wake"
    mode: PauseMode = PauseMode.ABORT
    level: int = 1  # sleep: 1 frees the prefix cache and MLX's buffer cache, 2 the weights too
    path: str | None = None  # wake: where the weights are read from after a level-2 sleep


@dataclass(frozen=True)
class ControlResult:
    paused: bool
    aborted: int = 0  # requests a pause ended
    held: int = 0  # requests a pause stopped where they are (kept or retracted)
    error: str | None = None


@dataclass(frozen=True)
class WeightUpdate:
    """New weights for the served model, from a directory or a safetensors file of the same
    architecture. Requests in flight finish on the old weights first, or are aborted."""

    path: str
    abort_in_flight: bool = False
    tag: str | None = None


@dataclass(frozen=True)
class WeightUpdateResult:
    version: WeightVersion
    error: str | None = None  # the weights were not loaded: why (the old ones stay)
    aborted: int = 0  # requests aborted for it
    seconds: float = 0.0  # from the request to the new weights in place
