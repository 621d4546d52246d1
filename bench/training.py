"""Training beside serving: one Tinker `forward_backward` + `optim_step` through the SDK against
the same step in mlx-lm's LoRA trainer, and the rollouts' throughput while training runs.

The same weights, the same batch of rollouts (B sequences of L tokens, cross-entropy on every
position after the first), LoRA of the same rank on every attention and MLP projection, Adam:

- mlx-lm: `linear_to_lora_layers` on the model `mlx_lm.load` gives (in the dtype our server
  computes in: float32 on the CPU, a quantized model dequantized), its trainer's
  `default_loss` under `nn.value_and_grad`, `optim.Adam`, evaluated each step: what its
  `train` loop does per batch (in this process, before the server starts);
- ours: the SDK's `forward_backward(..., "cross_entropy")` then `optim_step`, each waited on,
  through a real server: what a Tinker user's loop sees (HTTP, futures, the engine's turn);
- rollouts: c streams' completion tokens/s alone, then with a training loop running beside them
  in the same server (the engine interleaves training passes with decode steps).

    .venv/bin/python -m bench.training                       # the CPU preset, the embedded model
    python3 -m bench.training --preset gpu --model /root/m1b
"""

# ruff: noqa: I001  (omlx_logprobs before anything imports mlx: it preloads OpenBLAS, which
# mlx-lm's step in this process then uses as our server does; bench/mlx_lm_server.py)
from __future__ import annotations

from omlx_logprobs import BLAS

import argparse
import asyncio
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import LoadConfig, run_load
from bench.server import free_port, omlx_command, start_server

KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALPHA = 32.0  # Tinker's (training/lora.py): scale = alpha / rank


@dataclass(frozen=True)
class Preset:
    batch: int  # rollouts a step
    length: int  # tokens each
    rank: int
    steps: int  # timed steps (after one unmeasured)
    concurrency: int  # rollout streams
    max_tokens: int


PRESETS = {"cpu": Preset(8, 128, 8, 3, 8, 32), "gpu": Preset(32, 512, 32, 5, 32, 128)}


def rollouts(vocab: int, preset: Preset, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, vocab - 10, (preset.batch, preset.length))


def mlx_lm_step_s(model_dir: str, tokens: np.ndarray, preset: Preset) -> list[float]:
    """Each timed step of mlx-lm's own LoRA training on `tokens`."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from omlx_logprobs.models.dtype import apply_dtype

    model, _ = load(model_dir)
    # The activations' dtype our server computes in (models/dtype.py: on the CPU, float32, a
    # quantized model dequantized once), so that the two steps do the same arithmetic: MLX's
    # CPU quantized matmul alone made mlx-lm's step 16x ours on the embedded Q8 model.
    apply_dtype(model)
    model.freeze()
    config = {"rank": preset.rank, "scale": ALPHA / preset.rank, "dropout": 0.0}
    layers = len(model.layers)
    linear_to_lora_layers(model, layers, {**config, "keys": [k for k in _paths(model)]})
    opt = optim.Adam(learning_rate=1e-4)
    batch = mx.array(tokens)
    lengths = mx.array([[1, preset.length - 1]] * preset.batch)
    step = nn.value_and_grad(model, lambda m, b, n: default_loss(m, b, n)[0])
    times = []
    for i in range(preset.steps + 1):
        t0 = time.perf_counter()
        loss, grads = step(model, batch, lengths)
        opt.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), opt.state)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _paths(model: Any) -> list[str]:
    """The projections' paths within a block (mlx-lm's `keys`), as its first block names them."""
    import mlx.nn as nn

    return sorted(
        path
        for path, m in model.layers[0].named_modules()
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and path.rsplit(".", 1)[-1] in KEYS
    )


def datums(tokens: np.ndarray) -> list[Any]:
    from tinker import types

    out = []
    for row in tokens.tolist():
        n = len(row) - 1
        target = types.TensorData(data=row[1:], dtype="int64", shape=[n])
        weights = types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={"target_tokens": target, "weights": weights},
            )
        )
    return out


def our_step_s(client: Any, data: list[Any], steps: int) -> list[float]:
    from tinker import types

    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def rollouts_tok_s(base_url: str, model: str, preset: Preset, seed: int) -> float:
    cfg = LoadConfig(
        base_url=base_url,
        model=model,
        concurrency=preset.concurrency,
        requests=preset.concurrency * 2,
        max_tokens=preset.max_tokens,
        logprobs=1,
        seed=seed,
    )
    res = asyncio.run(run_load(cfg))
    if res.errors:
        raise RuntimeError(f"rollouts: {res.errors} errors: {res.error_samples}")
    return res.tokens_per_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    a = ap.parse_args()
    preset = PRESETS[a.preset]
    if a.model is None:
        from omlx_logprobs.models.embedded import ensure_embedded_model

        a.model = str(ensure_embedded_model())
    from transformers import AutoTokenizer

    print(f"BLAS: {BLAS}", flush=True)
    vocab = len(AutoTokenizer.from_pretrained(a.model))
    tokens = rollouts(vocab, preset)
    theirs = mlx_lm_step_s(a.model, tokens, preset)
    print(f"mlx-lm: a step {statistics.median(theirs):.3f} s ({theirs})", flush=True)

    import tinker

    port = free_port()
    server = start_server(omlx_command(port, a.model, 64), port)
    name = Path(a.model).name
    try:
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-local")
        client = service.create_lora_training_client(
            base_model=name, rank=preset.rank, seed=0, train_mlp=True
        ).result()
        data = datums(tokens)
        ours = our_step_s(client, data, preset.steps)
        print(f"ours: a step {statistics.median(ours):.3f} s ({ours})", flush=True)
        rollouts_tok_s(server.base_url, name, preset, seed=0)  # unmeasured: shapes built
        alone = rollouts_tok_s(server.base_url, name, preset, seed=1)
        done = threading.Event()
        trained = [0]

        def train() -> None:
            while not done.is_set():
                our_step_s(client, data, 0)
                trained[0] += 1

        beside = threading.Thread(target=train, daemon=True)
        beside.start()
        time.sleep(0.5)
        with_training = rollouts_tok_s(server.base_url, name, preset, seed=2)
        done.set()
        beside.join()
        service.close("success").result()
    finally:
        server.stop()
    mine, peer = statistics.median(ours), statistics.median(theirs)
    print("\n| | ours (Tinker SDK, server) | mlx-lm's LoRA trainer | ours / mlx-lm |")
    print("|---|---:|---:|---:|")
    print(
        f"| forward_backward + optim_step, {preset.batch} x {preset.length} tokens, rank"
        f" {preset.rank}, s | {mine:.3f} | {peer:.3f} | {mine / peer:.2f} |"
    )
    print(
        f"\nrollouts, c={preset.concurrency}, {preset.max_tokens} tokens, top 1: alone"
        f" {alone:.1f} tok/s, with training beside {with_training:.1f} tok/s"
        f" ({with_training / alone:.2f}); {trained[0]} training steps meanwhile"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
