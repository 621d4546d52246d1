"""A few steps of a GRPO-style loop written against Tinker's SDK alone, on the embedded
SmolLM2-135M-Instruct: the `tinker` package pointed at this server by its base URL, the model
trained in the server's process on the weights it serves (docs/specs/tinker.md).

- Each step saves the policy for sampling (`save_weights_and_get_sampling_client`: served at
  once as an adapter, no file), samples `n` choices per prompt with their logprobs, scores them
  (a toy reward: a colour named in the answer) and centres the rewards per prompt (GRPO).
- `forward_backward` with the `importance_sampling` loss on those rollouts, then `optim_step`
  (Adam). The server runs in batch-invariant mode (`--batch-invariant`), so the trainer's
  logprobs of the sampled tokens are the sampler's bit for bit: the largest |ratio - 1| the
  server reports (`ratio_deviation:max`) is 0.0 (`--no-invariant`: float noise, ~1e-6).

    make tinker-example        # or: .venv/bin/python examples/tinker_rl.py --steps 5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer

from omlx_logprobs.models.embedded import ensure_embedded_model

PROMPTS = [
    "Describe the sky at sunset in one sentence.",
    "What would you paint on a wall? Answer briefly.",
]
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "gold", "violet")


def reward(text: str) -> float:
    return 1.0 if any(c in text.lower() for c in COLOURS) else 0.0


def start_server(
    model_dir: Path, port: int, invariant: bool, name: str = "smollm2"
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--model", str(model_dir),
           "--served-model-name", name, "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    cmd += ["--batch-invariant"] if invariant else []
    proc = subprocess.Popen(cmd)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server did not start")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not start in time")


def rollout_data(
    prompt: list[int], seqs: list[types.SampledSequence], rewards: list[float]
) -> list[types.Datum]:
    """One importance-sampling datum a choice: the sampler's logprobs and the choice's
    advantage on its tokens, zeros on the prompt's."""
    adv = np.asarray(rewards) - np.mean(rewards)
    data = []
    for seq, a in zip(seqs, adv, strict=True):
        if a == 0 or not seq.tokens:
            continue
        k, n = len(prompt) - 1, len(prompt) + len(seq.tokens) - 1
        tokens = prompt + seq.tokens
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                    "logprobs": types.TensorData(
                        data=[0.0] * k + list(seq.logprobs or []), dtype="float32", shape=[n]
                    ),
                    "advantages": types.TensorData(
                        data=[0.0] * k + [float(a)] * len(seq.tokens), dtype="float32", shape=[n]
                    ),
                },
            )
        )
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--n", type=int, default=8, help="choices per prompt (a GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--no-invariant", action="store_true", help="the default server instead")
    a = ap.parse_args()

    model_dir = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in PROMPTS
    ]
    server = start_server(model_dir, a.port, not a.no_invariant)
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{a.port}", api_key="tml-local")
    try:
        tc = service.create_lora_training_client(
            base_model="smollm2", rank=a.rank, seed=0, train_mlp=False
        ).result()
        params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=7)
        for step in range(a.steps):
            t0 = time.perf_counter()
            sampler = tc.save_weights_and_get_sampling_client().result()
            futures = [sampler.sample(types.ModelInput.from_ints(p), a.n, params) for p in prompts]
            data: list[types.Datum] = []
            rewards: list[float] = []
            for p, f in zip(prompts, futures, strict=True):
                seqs = list(f.result().sequences)
                r = [reward(tokenizer.decode(s.tokens)) for s in seqs]
                rewards += r
                data += rollout_data(p, seqs, r)
            deviation = float("nan")
            if data:
                out = tc.forward_backward(data, "importance_sampling").result()
                deviation = out.metrics.get("ratio_deviation:max", float("nan"))
                tc.optim_step(types.AdamParams(learning_rate=a.lr)).result()
            print(
                f"step {step}: mean reward {np.mean(rewards):.3f}, {len(data)} datums, "
                f"max |ratio - 1| {deviation:.3g}, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        service.close("success").result()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
