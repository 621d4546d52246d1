"""Does our server's resident memory grow with requests, or with distinct kernel shapes?

    python -m bench.experiments.rss_shapes MODEL_DIR [REQUESTS_PER_PHASE [SERVER FLAGS...]]

Starts the server, then sends phases of closed-loop top-20 completions (concurrency 64, 16 new
tokens) whose prompts are token-id lists: `fixed` phases repeat one prompt length (the same
prefill and decode shapes again and again), `varied` ones draw a new length per request. RSS,
MLX active and cache memory are printed after each phase. Growth only in `varied` phases points
at per-shape state (kernel and plan caches), growth in every phase at per-request state.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import httpx

from bench.server import tree_rss_mib

PORT = 8109


def rss_mib(pid: int) -> float:
    return tree_rss_mib(pid)


async def phase(client: httpx.AsyncClient, model: str, n: int, lengths: list[int]) -> int:
    todo = list(range(n))
    errors = 0

    async def worker() -> None:
        nonlocal errors
        while todo:
            i = todo.pop()
            rng = random.Random(i * 7919 + len(lengths))
            prompt = [rng.randrange(100, 40000) for _ in range(rng.choice(lengths))]
            body = {
                "model": model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                "logprobs": 20, "temperature": 0,
            }  # fmt: skip
            r = await client.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body)
            errors += r.status_code != 200

    await asyncio.gather(*(worker() for _ in range(64)))
    return errors


async def main(model_dir: str, n: int, flags: list[str]) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--model", model_dir,
         "--port", str(PORT), "--max-num-seqs", "64", "--log-level", "warning", *flags],
    )  # fmt: skip
    model = model_dir.rstrip("/").rsplit("/", 1)[-1]
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            for _ in range(300):
                try:
                    if (await client.get(f"http://127.0.0.1:{PORT}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(1)
            varied = list(range(20, 160))
            for name, lengths in [("fixed", [64]), ("fixed", [64]), ("varied", varied),
                                  ("fixed", [64]), ("varied", varied), ("varied", varied),
                                  ("fixed", [64])]:  # fmt: skip
                t0 = time.perf_counter()
                errors = await phase(client, model, n, lengths)
                h = (await client.get(f"http://127.0.0.1:{PORT}/health")).json()["engine"]
                active, cache = h["active_memory"] / 2**20, h["cache_memory"] / 2**20
                print(
                    f"{name:<7} {n} requests in {time.perf_counter() - t0:5.1f} s, errors "
                    f"{errors}: RSS {rss_mib(server.pid):7.1f} MiB, MLX active "
                    f"{active:7.1f} MiB, cache {cache:7.1f}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 500, sys.argv[3:]))
