"""A storm of clients that leave mid-request, on every API, streamed or not: each request is
aborted wherever it is (waiting for a row, prefilling, decoding), so that two seconds after the
last client has gone the engine runs and waits for nothing, and the server still answers."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from tests.helpers.server import MODEL_NAME

ASK = "Tell me a very long story about a lighthouse keeper, number {i}."
LONG = 400  # tokens: far more than a client stays for


def _body(route: str, i: int, stream: bool) -> dict[str, Any]:
    text = ASK.format(i=i)
    messages = [{"role": "user", "content": text}]
    if route == "/v1/chat/completions":
        return {"messages": messages, "max_tokens": LONG, "ignore_eos": True, "stream": stream}
    if route == "/v1/completions":
        return {"prompt": text, "max_tokens": LONG, "ignore_eos": True, "stream": stream}
    if route == "/v1/responses":
        return {"input": text, "max_output_tokens": LONG, "stream": stream}
    if route == "/v1/messages":
        return {"messages": messages, "max_tokens": LONG, "stream": stream}
    if route == "/api/chat":
        return {"messages": messages, "options": {"num_predict": LONG}, "stream": stream}
    assert route == "/api/generate"
    return {"prompt": text, "options": {"num_predict": LONG}, "stream": stream}


ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/api/chat",
    "/api/generate",
]


async def _leave(base: str, route: str, i: int, stream: bool, stay: float) -> tuple[int, float]:
    """Send one request and go away after `stay` seconds (a streamed client once its first
    bytes came and its time is up; the other by a timeout). Returns the status seen (0 when
    none came) and when the client left."""
    body = {"model": MODEL_NAME, **_body(route, i, stream)}
    status = 0
    async with httpx.AsyncClient(timeout=120) as c:
        try:
            if stream:
                async with c.stream("POST", base + route, json=body) as r:
                    status = r.status_code
                    until = time.monotonic() + stay
                    async for _ in r.aiter_bytes():
                        if time.monotonic() > until:
                            break
            else:
                r = await asyncio.wait_for(c.post(base + route, json=body), stay)
                status = r.status_code
        except (TimeoutError, asyncio.TimeoutError, httpx.HTTPError):
            pass
    return status, time.monotonic()


async def _storm(base: str, n: int) -> list[tuple[int, float]]:
    rng = random.Random(7)
    return await asyncio.gather(
        *(
            _leave(
                base, ROUTES[i % len(ROUTES)], i, (i // len(ROUTES)) % 2 == 0, rng.uniform(0.3, 1.3)
            )
            for i in range(n)
        )
    )


def test_clients_that_leave_on_every_api_are_let_go_within_two_seconds(server: str) -> None:
    # 48 requests against 32 rows: some leave while waiting, some while prefilling or decoding
    seen = asyncio.run(_storm(server, 48))
    last_left = max(t for _, t in seen)
    assert all(s in (0, 200) for s, _ in seen), seen  # no request refused or failed
    engine: dict[str, Any] = {}
    while time.monotonic() - last_left < 2.0:
        engine = httpx.get(server + "/health", timeout=10).json()["engine"]
        if engine["running"] == engine["waiting"] == 0:
            break
        time.sleep(0.05)
    assert engine["running"] == engine["waiting"] == 0, engine
    # and the server still serves
    r = httpx.post(
        server + "/v1/chat/completions",
        json={"model": MODEL_NAME, **_body("/v1/chat/completions", 0, False), "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
