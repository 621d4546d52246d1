"""A few steps of a GRPO-style loop on one machine, on the embedded SmolLM2-135M-Instruct.

- Rollouts come from the server: `n` choices per prompt with their token ids and processed
  logprobs (the distribution sampled from, temperature included).
- The trainer (mlx-lm, LoRA on the last layers) recomputes the logprobs of the same tokens with
  its own forward pass. The server runs in batch-invariant mode (`--batch-invariant`), so the
  logprobs it returns depend on the tokens alone, and `omlx_logprobs.runner.scorer` computes
  them again bit for bit from the policy it served (its adapter, or its fused weights): the
  importance ratio printed is exactly 1 while both hold the same weights (`--no-invariant`:
  the default server and mlx-lm's own log-softmax, 1 within ~1e-4 in float32).
- After each training step the LoRA is saved in mlx-lm's adapter format and loaded in place
  under one name, `policy` (`POST /v1/load_lora_adapter` with `load_inplace`, as prime-rl
  does): the next batch names it as its `model`, the response's `adapter` (its name and the
  how-manieth load of that name) says which policy sampled it, and its ratios are 1 again.
  With `--weights fuse` the LoRA is instead fused into the weights and
  loaded in place (`POST /update_weights_from_disk`): the batch's `weight_version` says which
  weights sampled it.

The reward is a toy (a colour named in the answer); the mechanics are the point.

    make rl-example            # or: .venv/bin/python examples/rl_loop.py --steps 5 --png rl.png
"""

from __future__ import annotations

# isort: off
# The scorer sums as the server does on the same BLAS: OpenBLAS where it is installed, loaded
# before MLX (omlx_logprobs/blas.py), as the server loads it.
import omlx_logprobs  # noqa: F401  (first: the BLAS is chosen before MLX loads)

# isort: on
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load as mlx_lm_load

from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.models.embedded import ensure_embedded_model
from omlx_logprobs.runner.scorer import Scorer

PROMPTS = [
    "Describe the sky at sunset in one sentence.",
    "What would you paint on a wall? Answer briefly.",
]
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "gold", "violet")
LAYERS = 4  # the LoRA's blocks, the last ones
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}


def reward(text: str) -> float:
    return 1.0 if any(c in text.lower() for c in COLOURS) else 0.0


def start_server(model_dir: Path, port: int, invariant: bool) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    cmd += ["--batch-invariant"] if invariant else []
    proc = subprocess.Popen(cmd)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def rollouts(
    base: str, name: str, prompts: list[list[int]], a: argparse.Namespace, step: int
) -> dict[str, Any]:
    """`n` sampled completions per prompt: ids, processed logprobs, the weights' version. Choice
    i samples with seed + i (vLLM's rule): a step's seeds start past the last step's."""
    body = {
        "model": name, "prompt": prompts, "n": a.n, "max_tokens": a.max_tokens,
        "temperature": a.temperature, "seed": 1000 + step * a.n, "logprobs": 0,
        "logprobs_mode": "processed_logprobs", "return_token_ids": True,
    }  # fmt: skip
    r = httpx.post(base + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def token_logprobs(model: nn.Module, prompt: list[int], tokens: list[int], t: float) -> mx.array:
    """The trainer's processed logprobs of `tokens` after `prompt`: log-softmax(logits / T)."""
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    logp = nn.log_softmax(logits / t, axis=-1)
    return mx.take_along_axis(logp, mx.array(tokens)[:, None], axis=-1)[:, 0]


def exact_logprobs(model: nn.Module, prompt: list[int], tokens: list[int], t: float) -> np.ndarray:
    """The same, for the ratios printed: the float32 logits' log-softmax taken in float64 (MLX's
    float32 log-softmax over 49,152 entries is itself off by up to ~7e-5)."""
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    x = np.array(logits, np.float64) / t
    m = x.max(axis=-1, keepdims=True)
    logp = x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))
    return logp[np.arange(len(tokens)), tokens]


def grpo_loss(model: nn.Module, batch: list[dict], t: float, clip: float) -> mx.array:
    """The clipped surrogate over every token, each sequence weighted by its group advantage."""
    total, count = mx.array(0.0), 0
    for s in batch:
        new = token_logprobs(model, s["prompt"], s["tokens"], t)
        ratio = mx.exp(new - mx.array(s["logprobs"]))
        adv = s["advantage"]
        total = total - mx.minimum(ratio * adv, mx.clip(ratio, 1 - clip, 1 + clip) * adv).sum()
        count += len(s["tokens"])
    return total / max(count, 1)


def fused_weights(model: nn.Module) -> dict[str, mx.array]:
    """The model's parameters with every LoRA folded into its base weight (mlx-lm's `fuse`),
    under the base model's names: what the server loads."""
    params = dict(tree_flatten(model.parameters()))
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            for key in ("linear.weight", "lora_a", "lora_b"):
                params.pop(f"{name}.{key}")
            params[f"{name}.weight"] = m.fuse().weight
            if f"{name}.linear.bias" in params:
                params[f"{name}.bias"] = params.pop(f"{name}.linear.bias")
    return params


def save_adapter(model: nn.Module, out: Path) -> None:
    """The LoRA as `mlx_lm.lora` saves it: its trainable parameters and their config."""
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"),
                        dict(tree_flatten(model.trainable_parameters())))  # fmt: skip
    config = {"fine_tune_type": "lora", "num_layers": LAYERS, "lora_parameters": LORA}
    (out / "adapter_config.json").write_text(json.dumps(config))


def publish(base: str, model: nn.Module, ckpt: Path, step: int, a: argparse.Namespace) -> str:
    """The policy after `step` training steps, on the server: the model name to sample from."""
    if a.weights == "fuse":
        if step:
            mx.save_safetensors(str(ckpt / "model.safetensors"), fused_weights(model))
            r = httpx.post(
                base + "/update_weights_from_disk",
                json={"model_path": str(ckpt), "weight_version": f"step-{step}"},
                timeout=600,
            )
            r.raise_for_status()
        return str(httpx.get(base + "/v1/models").json()["data"][0]["id"])
    # One name reloaded in place each step (prime-rl's way): each response names the adapter
    # and which load of that name made it, so the policies stay apart.
    save_adapter(model, ckpt / f"step-{step}")
    body = {"lora_name": "policy", "lora_path": str(ckpt / f"step-{step}"), "load_inplace": True}
    httpx.post(base + "/v1/load_lora_adapter", json=body, timeout=600).raise_for_status()
    return "policy"


def follow(scorer: Scorer, model: nn.Module, ckpt: Path, step: int, a: argparse.Namespace) -> None:
    """The scorer takes the policy `publish` gave the server: the same adapter files, or the
    same fused weights."""
    if a.weights == "adapter":
        scorer.load_adapter(str(ckpt / f"step-{step}"))
    elif step:
        scorer.model.load_weights(list(fused_weights(model).items()))
        mx.eval(scorer.model.parameters())


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    top.plot(steps, [h["reward"] for h in history], marker="o")
    top.set_ylabel("mean reward")
    bottom.plot(steps, [h["max_ratio_error"] for h in history], marker="o", color="tab:red")
    bottom.set_yscale("log")
    bottom.set_ylabel("max |ratio - 1| before the step")
    bottom.set_xlabel("step (the policy of the rollouts)")
    bottom.set_xticks(steps)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="choices per prompt (a GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--png", type=Path, default=Path("rl_loop.png"))
    ap.add_argument(
        "--weights",
        choices=["adapter", "fuse"],
        default="adapter",
        help="how the server gets each step's policy: the LoRA as an adapter (load_lora_adapter),"
        " or fused into the weights (update_weights_from_disk)",
    )
    ap.add_argument(
        "--no-invariant",
        action="store_true",
        help="the default server, ratios from the trainer's own float64 log-softmax",
    )
    a = ap.parse_args()
    mlx_environment()
    model_dir = ensure_embedded_model()
    server = start_server(model_dir, a.port, not a.no_invariant)
    base = f"http://127.0.0.1:{a.port}"
    try:
        model, tokenizer = mlx_lm_load(str(model_dir))[:2]
        model.set_dtype(mx.float32)  # the server's dtype on the CPU: the same numbers
        model.freeze()
        linear_to_lora_layers(model, LAYERS, LORA)
        opt = optim.Adam(learning_rate=a.lr)
        step_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, a.temperature, a.clip))
        prompts = [chat_prompt(tokenizer, q) for q in PROMPTS]
        scorer = None if a.no_invariant else Scorer(str(model_dir))
        history = []
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp)
            for step in range(a.steps):
                name = publish(base, model, ckpt, step, a)
                res = rollouts(base, name, prompts, a, step)
                version = res["weight_version"]
                if a.weights == "adapter":  # the adapter and its load: the policy sampled
                    policy = f"{res['adapter']['name']} (load {res['adapter']['load']})"
                else:
                    policy = version["tag"] or "start"
                batch = []
                for c in res["choices"]:
                    p = c["index"] // a.n
                    batch.append({
                        "prompt": prompts[p], "group": p, "tokens": c["token_ids"],
                        "logprobs": c["logprobs"]["token_logprobs"], "reward": reward(c["text"]),
                    })  # fmt: skip
                for p in range(len(prompts)):
                    group = [s for s in batch if s["group"] == p]
                    rs = np.array([s["reward"] for s in group])
                    for s in group:
                        s["advantage"] = float((s["reward"] - rs.mean()) / (rs.std() + 1e-4))
                if scorer is not None:  # the policy the server sampled from, as it served it
                    follow(scorer, model, ckpt, step, a)
                errors = []
                for s in batch:
                    if scorer is None:
                        mine = exact_logprobs(model, s["prompt"], s["tokens"], a.temperature)
                    else:
                        ids, start = s["prompt"] + s["tokens"], len(s["prompt"])
                        mine = scorer.logprobs(ids, start, a.temperature).astype(np.float64)
                    served = np.array(s["logprobs"], np.float32).astype(np.float64)
                    errors.append(float(np.abs(np.exp(mine - served) - 1).max()))
                loss, grads = step_fn(model, batch)
                opt.update(model, grads)
                mx.eval(model.parameters(), opt.state)
                mean_r = float(np.mean([s["reward"] for s in batch]))
                history.append({"step": step, "reward": mean_r,
                                "max_ratio_error": max(errors)})  # fmt: skip
                print(
                    f"step {step}: rollouts from {policy} (weight version {version['counter']}), "
                    f"reward {mean_r:.2f}, importance ratio max |r - 1| {max(errors):.2e}, "
                    f"loss {float(loss):.4f}",
                    flush=True,
                )
        plot(history, a.png)
        print(f"plot: {a.png}")
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
