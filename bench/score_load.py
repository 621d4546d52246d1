"""Prompt scoring against plain prefill on a running server, alternating, in one run.

python bench/score_load.py BASE_URL MODEL CONCURRENCY REQUESTS PROMPT_WORDS
"""

from __future__ import annotations

import asyncio
import sys

import scoring
from loadgen import LoadConfig, run_load


async def main(base: str, model: str, c: int, n: int, words: int) -> None:
    for name, send in (("prefill", scoring.send_prefill), ("score", scoring.send_score)) * 2:
        cfg = LoadConfig(base_url=base, model=model, concurrency=c, requests=n, prompt_words=words)
        r = await run_load(cfg, send)
        print(
            f"{name:<8} {r.prompt_tokens / r.wall_s:9.1f} prompt tok/s, errors {r.errors}",
            flush=True,
        )


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], int(a[2]), int(a[3]), int(a[4])))
