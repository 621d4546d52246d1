"""tinker-cookbook's math_rl recipe (`tinker_cookbook.recipes.math_rl.train`, its arithmetic
environment), run unmodified against this server: the recipe's own CLIConfig and cli_main,
with only what must differ from its stock config changed.

- `base_url`, the API key (TINKER_API_KEY) and `model_name`: the server, and the served
  model's name, which is its directory so that the recipe's `get_tokenizer` loads offline.
- `renderer_name`: the recipe picks one from its table of hosted models, where a local one is
  not. SmolLM2's chat template is ChatML, which the cookbook's `qwen3_instruct` renderer
  writes token for token (without SmolLM2's default system prompt), stopping at `<|im_end|>`.
- `loss_fn="importance_sampling"` (the recipe's CLI default is `stable_reinforce`, whose
  objective Tinker's documentation does not give: it uses "stability information" the hosted
  sampler records, which this server does not have), `max_steps`, and `log_path` (a fresh
  folder).
- The batch and the learning rate, sized for a 135M model on two CPU cores: the stock 100
  groups of 4 at 1e-5 (a rate the recipe sets for its 9B default) take a quarter of an hour a
  step here and move nothing in three. 16 groups of 8 at 1e-3: the rate tinker-cookbook's
  own `hyperparam_utils.get_lr` gives a Llama-shaped model of SmolLM2-135M's hidden size
  (5e-4 x (2000 / 576) ^ 0.781 = 1.3e-3, LoRA's 10x included), rounded down.

The recipe does not log forward_backward's metrics; to print the largest |ratio - 1| the
server reports for each step (`ratio_deviation:max`), this driver wraps the recipe's reading of
forward_backward's result, passing the result through unchanged.

Runs in `.venv-tinker` (`make tinker-venv`); `make tinker-example` starts the server and runs it
(examples/tinker_cookbook_rl.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import tinker
from tinker_cookbook.recipes.math_rl import train as recipe
from tinker_cookbook.rl import train as rl_train

DEVIATIONS: list[float] = []


def record_deviation() -> None:
    """Keep each forward_backward's `ratio_deviation:max` as the recipe reads its result."""
    read = rl_train._training_logprobs_from_fwd_bwd

    def reading(result: tinker.ForwardBackwardOutput) -> Any:
        DEVIATIONS.append(float(result.metrics.get("ratio_deviation:max", float("nan"))))
        return read(result)

    rl_train._training_logprobs_from_fwd_bwd = reading


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True, help="the served model's name (its directory)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--renderer", default="qwen3_instruct")
    ap.add_argument("--groups", type=int, default=16, help="the recipe's groups_per_batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--log-path", default="/tmp/omlx-tinker-cookbook")
    a = ap.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    record_deviation()
    config = recipe.CLIConfig(
        model_name=a.model,
        base_url=a.base_url,
        renderer_name=a.renderer,
        loss_fn="importance_sampling",
        groups_per_batch=a.groups,
        group_size=a.group_size,
        learning_rate=a.learning_rate,
        max_steps=a.steps,
        log_path=a.log_path,
        behavior_if_log_dir_exists="delete",
    )
    started = time.perf_counter()
    asyncio.run(recipe.cli_main(config))
    wall = time.perf_counter() - started
    steps = [json.loads(line) for line in (Path(a.log_path) / "metrics.jsonl").open()]
    steps = [s for s in steps if "env/all/reward/total" in s]
    print(f"\ntinker-cookbook math_rl (arithmetic), {a.model}:")
    for s, dev in zip(steps, DEVIATIONS, strict=False):
        print(
            f"step {s['step']}: reward {s['env/all/reward/total']:.3f},"
            f" max |ratio - 1| {dev:.3g}, {s.get('time/total', float('nan')):.1f} s"
        )
    print(f"{len(steps)} steps in {wall:.0f} s")


if __name__ == "__main__":
    main()
