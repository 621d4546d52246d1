"""What the API asks of the trainer, one record each, and what it answers: frozen, picklable and
free of MLX, so that they cross to an engine in a child process as the engine's other commands
do (engine/commands.py's `Train`). Arrays are numpy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LoraSpec:
    """Tinker's `LoraConfig`: the rank, the seed of the initial weights, and which layers."""

    rank: int
    seed: int | None = None
    attn: bool = True
    mlp: bool = True
    unembed: bool = True


@dataclass(frozen=True)
class AdamSpec:
    """Tinker's `AdamParams` (decoupled weight decay; grad_clip_norm 0: no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class CreateRun:
    run_id: str
    lora: LoraSpec


@dataclass(frozen=True)
class DatumPass:
    """One datum's forward (and backward, its gradients added to the run's): `tokens` the
    model's input [N] int32, `inputs` the loss's `loss_fn_inputs` (each [N])."""

    run_id: str
    tokens: np.ndarray
    inputs: dict[str, np.ndarray]
    loss_fn: str
    config: dict[str, float] = field(default_factory=dict)
    backward: bool = True


@dataclass(frozen=True)
class BatchPass:
    """Datums of one run, loss and direction (a forward_backward's), done in as few padded
    forwards as the engine admits when each runs (engine/trainings.py): at most a prefill
    step's tokens each, within the memory free beside the batch then; answered with their
    `DatumResult`s in order. `token_bytes`: what one token of a forward and backward holds
    (its logits, their gradients, its keys and values; 0: not bounded by memory)."""

    passes: tuple[DatumPass, ...]
    token_bytes: int = 0


@dataclass(frozen=True)
class OptimStep:
    """Adam on the gradients added since the last step; they are zeroed after it."""

    run_id: str
    adam: AdamSpec


@dataclass(frozen=True)
class Publish:
    """Serve the run's weights as they are now as the LoRA adapter `name` (replaced if it is
    served already: rows running on the old one finish on it)."""

    run_id: str
    name: str


@dataclass(frozen=True)
class DropRun:
    run_id: str


@dataclass(frozen=True)
class SaveRun:
    """Write the run's checkpoint into `directory` (training/checkpoint.py), with the optimizer
    state if asked; `base` is the served model's name, kept with it."""

    run_id: str
    directory: str
    base: str
    optimizer: bool = True


@dataclass(frozen=True)
class LoadRun:
    """Load a checkpoint into the run (`create`: a new run made from it), with its optimizer
    state if asked (else the optimizer starts afresh); answered with a `Loaded`."""

    run_id: str
    directory: str
    optimizer: bool
    create: bool


@dataclass(frozen=True)
class Loaded:
    base: str
    lora: LoraSpec
    layers: list[str]


TrainCall = CreateRun | DatumPass | BatchPass | OptimStep | Publish | DropRun | SaveRun | LoadRun


@dataclass(frozen=True)
class DatumResult:
    """A datum's per-position target logprobs and loss terms [N] float32, its loss, and the
    largest |exp(logprob - sampling logprob) - 1| where the loss had sampling logprobs."""

    logprobs: np.ndarray
    elementwise_loss: np.ndarray
    loss: float
    ratio_deviation: float | None = None


@dataclass(frozen=True)
class TrainAnswer:
    """The call's value, or why it failed (`user`: the request's fault, not the server's)."""

    value: Any = None
    error: str | None = None
    user: bool = True
