"""LoRA adapters for the tests, made with mlx-lm's own tuner (its LoRA layers over the tiny model,
seeded random weights, saved as `mlx_lm.lora` saves them), and the independent reference: the
same adapter fused into the model by mlx-lm (`LoRALinear.fuse`, as `mlx_lm.fuse` does)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
from mlx_lm.utils import load_model as mlx_load_model

from omlx_logprobs.models.loader import LoadedModel, load_model


def make_adapter(
    out: Path,
    model_dir: Path,
    seed: int,
    rank: int = 4,
    scale: float = 2.0,
    num_layers: int = 2,
    keys: list[str] | None = None,
) -> Path:
    """An mlx-lm adapter directory for the model at `model_dir`: LoRA layers on its last
    `num_layers` blocks (`keys`: which linear layers, default all), lora_a and lora_b random
    (a trained adapter's lora_b is not zero), large enough to move the logprobs visibly."""
    model, _ = mlx_load_model(model_dir)
    model.freeze()
    params: dict[str, Any] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    rng = mx.random.split(mx.random.key(seed), len(trainable))
    weights = {}
    for key, (name, w) in zip(rng, sorted(trainable.items())):
        std = 0.3 if name.endswith("lora_a") else 0.1
        weights[name] = std * mx.random.normal(w.shape, key=key)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def fused(model_dir: Path, adapter_dir: Path) -> LoadedModel:
    """The model with the adapter fused into its weights by mlx-lm, loaded as the server loads
    a model (float32 on the CPU): the reference an adapter's requests are checked against."""
    loaded = load_model(str(model_dir))
    net = load_adapters(loaded.model, str(adapter_dir))
    layers = [(n, m.fuse()) for n, m in net.named_modules() if hasattr(m, "fuse")]
    net.update_modules(tree_unflatten(layers))
    mx.eval(net.parameters())
    return replace(loaded, model=net)
