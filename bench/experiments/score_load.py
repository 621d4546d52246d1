"""Prompt scoring against plain prefill on a running server, alternating, in one run.

python bench/experiments/score_load.py BASE_URL MODEL CONCURRENCY REQUESTS PROMPT_WORDS
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: loadgen, scoring

import scoring  # noqa: E402
from loadgen import LoadConfig, run_load  # noqa: E402


async def main(base: str, model: str, c: int, n: int, words: int) -> None:
    # New prompts every run (seed), so that no run reuses the kernel shapes of an earlier one.
    for seed, (name, send) in enumerate(
        (("prefill", scoring.send_prefill), ("score", scoring.send_score)) * 3
    ):
        cfg = LoadConfig(
            base_url=base, model=model, concurrency=c, requests=n, prompt_words=words, seed=seed
        )
        r = await run_load(cfg, send)
        print(
            f"{name:<8} {r.prompt_tokens / r.wall_s:9.1f} prompt tok/s, errors {r.errors}",
            flush=True,
        )


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], int(a[2]), int(a[3]), int(a[4])))
