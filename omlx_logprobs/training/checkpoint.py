"""A training run's checkpoint: a directory in mlx-lm's adapter format, so that `serve --lora
NAME=DIR`, `mlx_lm.generate --adapter-path DIR` and a later `load_weights` all read it.

- `adapters.safetensors`: each adapted layer's `PATH.lora_a` [in, r] and `PATH.lora_b` [r, out]
  (float32), named by the layer's path in the model, as `mlx_lm.lora` saves them.
- `adapter_config.json`: mlx-lm's keys (`fine_tune_type` "lora", `num_layers`, and
  `lora_parameters` with `rank`, `scale`, `dropout`, `keys`), and under `tinker` what a run is
  made from again: the LoRA spec, the base model's name, the optimizer steps taken.
- `optimizer.safetensors` (with the optimizer state): Adam's `step` and `learning_rate`, and
  `PATH|lora_a|m` and the like for each moment (a layer's path holds dots, so `|` joins).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from omlx_logprobs.training.calls import LoraSpec
from omlx_logprobs.training.lora import Params, TrainableLora

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"
OPTIMIZER = "optimizer.safetensors"
SEP = "|"


class CheckpointError(ValueError):
    """The directory holds no checkpoint this server wrote, or one it cannot read."""


@dataclass
class Checkpoint:
    spec: LoraSpec
    base: str
    steps: int
    params: Params
    optimizer: dict[str, Any] | None  # mlx's optimizer state, when asked and saved


def write(
    directory: Path,
    lora: TrainableLora,
    params: Params,
    base: str,
    steps: int,
    optimizer: dict[str, Any] | None,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = {f"{path}.{k}": v for path, p in params.items() for k, v in p.items()}
    mx.save_safetensors(str(directory / WEIGHTS), weights)
    blocks = {path.split(".layers.", 1)[1].split(".", 1)[0] for path in params}
    keys = sorted({path.split(".layers.", 1)[1].split(".", 1)[1] for path in params})
    config = {
        "fine_tune_type": "lora",
        "num_layers": len(blocks),
        "lora_parameters": {"rank": lora.spec.rank, "scale": lora.scale, "dropout": 0.0,
                            "keys": keys},
        "tinker": {"lora": asdict(lora.spec), "base_model": base, "steps": steps},
    }  # fmt: skip
    (directory / CONFIG).write_text(json.dumps(config, indent=1))
    if optimizer is not None:
        flat = {k: v for k, v in optimizer.items() if isinstance(v, mx.array)}
        for path, p in optimizer.items():
            if isinstance(p, dict):
                for name, moments in p.items():
                    for m, v in moments.items():
                        flat[SEP.join((path, name, m))] = v
        mx.save_safetensors(str(directory / OPTIMIZER), flat)
    elif (directory / OPTIMIZER).exists():
        (directory / OPTIMIZER).unlink()


def base_of(directory: Path) -> str:
    """The base model's name a checkpoint was trained on (its config alone is read)."""
    return _meta(directory)[0]


def spec_of(directory: Path) -> LoraSpec:
    """A checkpoint's LoRA spec (its config alone is read)."""
    return _meta(directory)[1]


def _meta(directory: Path) -> tuple[str, LoraSpec]:
    """The base model and the LoRA spec a checkpoint's config names."""
    try:
        meta = json.loads((directory / CONFIG).read_text())["tinker"]
        return str(meta["base_model"]), LoraSpec(**meta["lora"])
    except FileNotFoundError:
        raise CheckpointError(f"{directory} holds no checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{directory} is not a checkpoint this server wrote: {e}") from None


def read(directory: Path, optimizer: bool) -> Checkpoint:
    try:
        config = json.loads((directory / CONFIG).read_text())
        meta = config["tinker"]
        spec = LoraSpec(**meta["lora"])
        tensors = mx.load(str(directory / WEIGHTS))
    except FileNotFoundError:
        raise CheckpointError(f"{directory} holds no checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{directory} is not a checkpoint this server wrote: {e}") from None
    assert isinstance(tensors, dict)
    params: Params = {}
    for name, v in tensors.items():
        path, _, k = name.rpartition(".")
        params.setdefault(path, {})[k] = v
    state: dict[str, Any] | None = None
    if optimizer and (directory / OPTIMIZER).exists():  # none: saved before any step
        flat = mx.load(str(directory / OPTIMIZER))
        assert isinstance(flat, dict)
        state = {}
        for key, v in flat.items():
            parts = key.split(SEP)
            if len(parts) == 1:
                state[key] = v
            else:
                state.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = v
    return Checkpoint(spec, str(meta.get("base_model", "")), int(meta.get("steps", 0)),
                      params, state)  # fmt: skip
