"""Prompt-scoring loads on OpenAI's legacy `/v1/completions`, for `loadgen.run_load`.

`send_score` is what lm-evaluation-harness sends to score a prompt (`echo: true, max_tokens: 0,
logprobs: 1`) and checks the legacy shape (`choices[].logprobs.token_logprobs`, one entry per
prompt token, the first one null). `send_prefill` is the same prompt with one generated token and
no logprobs: our server's own plain prefill, for comparison.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.loadgen import LoadConfig, RequestRecord, make_prompt


def score_body(cfg: LoadConfig, index: int) -> dict[str, Any]:
    return {
        "model": cfg.model,
        "prompt": make_prompt(index, cfg.prompt_words, cfg.seed),
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "temperature": 0.0,
    }


def prefill_body(cfg: LoadConfig, index: int) -> dict[str, Any]:
    return {
        "model": cfg.model,
        "prompt": make_prompt(index, cfg.prompt_words, cfg.seed),
        "max_tokens": 1,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def check_echo(data: dict[str, Any], prompt_tokens: int) -> str | None:
    """None when the legacy logprobs cover every prompt token, else why not."""
    lp = data["choices"][0].get("logprobs") or {}
    values = lp.get("token_logprobs")
    tops = lp.get("top_logprobs")
    tokens = lp.get("tokens")
    if values is None or tops is None or tokens is None:
        return f"logprobs has no tokens/token_logprobs/top_logprobs: keys {sorted(lp)}"
    if not len(values) == len(tops) == len(tokens) == prompt_tokens:
        n = (len(tokens), len(values), len(tops))
        return f"tokens/token_logprobs/top_logprobs have {n} entries, prompt has {prompt_tokens}"
    if values[0] is not None:
        return "first prompt token has a logprob (expected null)"
    for i in range(1, prompt_tokens):
        if not isinstance(values[i], (int, float)) or not tops[i]:
            return f"position {i}: logprob {values[i]!r}, top {tops[i]!r}"
    return None


async def _post(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[RequestRecord, dict[str, Any] | None]:
    t0 = time.perf_counter()
    r = await client.post("/completions", json=body)
    rec = RequestRecord(time.perf_counter() - t0)
    if r.status_code != 200:
        rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
        return rec, None
    data = r.json()
    usage = data.get("usage") or {}
    rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
    rec.completion_tokens = int(usage.get("completion_tokens", 0))
    return rec, data


async def send_score(client: httpx.AsyncClient, cfg: LoadConfig, index: int) -> RequestRecord:
    rec, data = await _post(client, score_body(cfg, index))
    if data is not None:
        if rec.completion_tokens != 0:
            rec.error = f"{rec.completion_tokens} completion tokens with max_tokens 0"
        else:
            rec.error = check_echo(data, rec.prompt_tokens)
    return rec


async def send_prefill(client: httpx.AsyncClient, cfg: LoadConfig, index: int) -> RequestRecord:
    rec, data = await _post(client, prefill_body(cfg, index))
    if data is not None and rec.completion_tokens != 1:
        rec.error = f"{rec.completion_tokens} completion tokens, expected 1"
    return rec


async def endpoint_status(base_url: str, model: str) -> int:
    """HTTP status of one small scoring request: 404 means the server has no /v1/completions."""
    body = score_body(LoadConfig(base_url=base_url, model=model, prompt_words=4), 0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as c:
        return (await c.post("/completions", json=body)).status_code
