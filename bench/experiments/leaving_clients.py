"""Clients that leave: 100 chat requests of 200 tokens to a running server, each client leaving
0.3-1.3 s after its response starts (streamed: once its headers came; not streamed: a timeout),
and the server's `/health` every half second: how many have left, and the engine's running and
waiting rows (a request whose client left should be aborted within a second).

    .venv/bin/python -m bench.experiments.leaving_clients --port 8000 --model NAME [--no-stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx


async def client(base: str, model: str, i: int, stream: bool, left: list[float]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me a long story number {i}."}],
        "max_tokens": 200,
        "stream": stream,
        "ignore_eos": True,
    }
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            if stream:
                async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    until = time.time() + random.uniform(0.3, 1.3)
                    async for _ in r.aiter_bytes():
                        if time.time() > until:
                            break
            else:
                post = c.post(f"{base}/v1/chat/completions", json=body)
                await asyncio.wait_for(post, random.uniform(0.3, 1.3))
    except (httpx.HTTPError, asyncio.TimeoutError):
        pass
    left.append(time.time())


async def main(base: str, model: str, stream: bool, seconds: float) -> None:
    t0, left = time.time(), []  # type: ignore[var-annotated]
    tasks = [asyncio.create_task(client(base, model, i, stream, left)) for i in range(100)]
    async with httpx.AsyncClient() as c:
        while time.time() - t0 < seconds:
            await asyncio.sleep(0.5)
            engine = (await c.get(f"{base}/health")).json()["engine"]
            rows = {k: engine[k] for k in ("running", "waiting")}
            print(f"{time.time() - t0:5.1f} s  left {len(left):3d}  {json.dumps(rows)}", flush=True)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", required=True)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--seconds", type=float, default=30.0)
    a = ap.parse_args()
    asyncio.run(main(f"http://127.0.0.1:{a.port}", a.model, not a.no_stream, a.seconds))
