"""Closed-loop load generator for any OpenAI-compatible chat completions endpoint.

`concurrency` workers, each with its own connection, send requests back to back until `requests`
are done. Output length is pinned with `max_tokens` + `ignore_eos` so that tokens/s compares like
with like, and every response is checked (status, token count, logprobs shape): a fast server
that returns the wrong thing must not look good. A non-streamed body is parsed and checked once
the clock has stopped: a 128-token top-20 body (~230 KB of JSON) takes a Python process 4-8 ms
to parse, which a closed loop would otherwise count as the server's time (the worker's next
request waited on it). `--processes N` splits the workers over N client processes, each with
its own event loop (a streamed run parses every chunk as it comes).

    .venv/bin/python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --concurrency 8 \
        --requests 32 --logprobs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

# A fixed vocabulary of plain English words: every one is a common token or two, so prompt length
# in tokens stays close to --prompt-words whatever the tokenizer.
WORDS = (
    "river stone garden window market yellow silver winter summer forest planet engine "
    "letter castle bridge pocket ladder candle hammer basket mirror orange purple violet "
    "gentle quiet bright heavy simple rapid silent golden wooden paper glass metal cloud "
    "storm island valley desert ocean harbor station village museum library kitchen "
    "doctor farmer painter sailor teacher writer singer dancer pilot baker travel build "
    "carry follow gather listen measure notice offer open paint reach remember return "
    "share start study turn visit wander write answer balance change circle corner "
    "danger effort family friend future history memory moment number people reason "
    "season signal spirit system theory thought value wonder animal button coffee "
    "dinner flower guitar jacket kettle lemon monkey needle pencil rabbit saddle tiger"
).split()


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    concurrency: int = 1
    requests: int = 8
    max_tokens: int = 64
    logprobs: int | None = None  # None: no logprobs field; k: logprobs=true, top_logprobs=k
    stream: bool = False
    prompt_words: int = 32
    temperature: float = 0.0
    seed: int = 0  # prompt seed; request i of seed s always gets the same prompt
    timeout_s: float = 600.0
    # True: every entry must have OpenAI's four keys. False, for peers known to differ (mlx-lm:
    # no `bytes`, no top list when top_logprobs is 0): only counts and the logprob are checked.
    strict: bool = True
    # Token ids banned through `logit_bias`: fixes the output length on servers that do not
    # know `ignore_eos` (mlx-lm), by making EOS unreachable at temperature 0.
    ban_token_ids: tuple[int, ...] = ()
    processes: int = 1  # client processes sharing the workers and requests, one event loop each
    # Parse and check each body inside the worker's loop, before its next request, as a user's
    # script does (the default parses after the clock stops: the server's time alone).
    parse_in_loop: bool = False
    logprobs_format: str = "openai"  # or the compact "columnar" / "base64" (decoded to numpy)
    # Every request constrained by JSON_SCHEMA (response_format json_schema, strict): a schema
    # no answer can complete within max_tokens, so output lengths stay pinned.
    json_schema: bool = False
    first_index: int = 0  # the first request's index (prompts are a function of it)
    # A Predicted Output sent with every request (`prediction`, OpenAI's field): only its
    # speed changes, so the guard sends one that never matches (bench/guard.py).
    prediction: str | None = None


@dataclass
class RequestRecord:
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    # perf_counter (CLOCK_MONOTONIC) when the worker sent it, and when it was done with the
    # response (the body arrived at sent_at + latency_s)
    sent_at: float = 0.0
    done_at: float = 0.0
    body: bytes | None = field(default=None, repr=False)  # unchecked until the clock stops


@dataclass
class LoadResult:
    config: LoadConfig
    ok: int
    errors: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    prompt_tokens: int
    prompt_tokens_per_s: float
    requests_per_s: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    error_samples: list[str] = field(default_factory=list)
    # Per-request data, kept so runs of the same cell can be merged with exact percentiles.
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["records"]
        return d


def make_prompt(index: int, words: int, seed: int = 0) -> str:
    """Deterministic and distinct per request; the index leads so no two prompts share a prefix
    beyond the chat template's own (which prefix caching, ours and mlx-lm's server's, reuses)."""
    rng = random.Random(seed * 1_000_003 + index)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Request {index}: {body}"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# At least 64 short strings: more tokens than any max_tokens the presets use.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 64,
            "maxItems": 64,
        },
    },
    "required": ["title", "notes"],
    "additionalProperties": False,
}


def request_body(cfg: LoadConfig, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": make_prompt(index, cfg.prompt_words, cfg.seed)}],
        "max_tokens": cfg.max_tokens,
        "ignore_eos": True,
        "temperature": cfg.temperature,
        "stream": cfg.stream,
    }
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = cfg.logprobs
        if cfg.logprobs_format != "openai":
            body["logprobs_format"] = cfg.logprobs_format
    if cfg.prediction is not None:
        body["prediction"] = {"type": "content", "content": cfg.prediction}
    if cfg.ban_token_ids:
        body["logit_bias"] = {str(t): -100 for t in cfg.ban_token_ids}
    if cfg.json_schema:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "notes", "schema": JSON_SCHEMA, "strict": True},
        }
    return body


def check_logprobs(content: list[Any] | dict[str, Any] | None, cfg: LoadConfig) -> str | None:
    """None when the logprobs match the request, else why not."""
    if cfg.logprobs is None:
        return None if not content else "logprobs returned but not asked for"
    if isinstance(content, dict):  # the compact form, decoded as its users do
        from omlx_logprobs.logprobs.columnar import decode_block

        block = decode_block(content)
        if len(block) != cfg.max_tokens or block.top_ids.shape[1] != cfg.logprobs:
            return f"compact logprobs of shape {block.top_ids.shape}, expected k={cfg.logprobs}"
        return None
    if content is None or len(content) != cfg.max_tokens:
        n = None if content is None else len(content)
        return f"logprobs.content has {n} entries, expected {cfg.max_tokens}"
    keys = ("token", "logprob", "bytes", "top_logprobs") if cfg.strict else ("logprob",)
    for i, entry in enumerate(content):
        missing = [k for k in keys if k not in entry]
        if missing:
            return f"entry {i}: no {missing}"
        if not isinstance(entry["logprob"], (int, float)):
            return f"entry {i}: logprob is {entry['logprob']!r}"
        if not cfg.strict and cfg.logprobs == 0:
            continue
        top = entry.get("top_logprobs")
        if top is None or len(top) != cfg.logprobs:
            got = None if top is None else len(top)
            return f"entry {i}: top_logprobs has {got} items, expected {cfg.logprobs}"
    return None


async def _complete(client: httpx.AsyncClient, cfg: LoadConfig, index: int) -> RequestRecord:
    t0 = time.perf_counter()
    r = await client.post("/chat/completions", json=request_body(cfg, index))
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        return RequestRecord(latency, error=f"HTTP {r.status_code}: {r.text[:200]}")
    return RequestRecord(latency, body=r.content)


def check_body(rec: RequestRecord, cfg: LoadConfig) -> None:
    """Parse and check a non-streamed response's body (after the run): counts and error."""
    body, rec.body = rec.body, None
    try:
        data = json.loads(body or b"")
        usage = data.get("usage") or {}
        rec.completion_tokens = n = int(usage.get("completion_tokens", 0))
        rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
        lp = data["choices"][0].get("logprobs")
        rec.error = _check_count(n, cfg) or check_logprobs((lp or {}).get("content"), cfg)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def _stream(client: httpx.AsyncClient, cfg: LoadConfig, index: int) -> RequestRecord:
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    content: list[Any] = []
    async with client.stream("POST", "/chat/completions", json=request_body(cfg, index)) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return RequestRecord(time.perf_counter() - t0, error=f"HTTP {r.status_code}: {text}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                return RequestRecord(time.perf_counter() - t0, error=f"stream error: {payload}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                # The role-only opening chunk has content "": TTFT is the first real text.
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
                content.extend((choice.get("logprobs") or {}).get("content") or [])
    rec = RequestRecord(time.perf_counter() - t0, ttft_s=ttft)
    if usage is None:
        rec.error = "no usage chunk (stream_options.include_usage ignored?)"
        return rec
    rec.completion_tokens = int(usage.get("completion_tokens", 0))
    rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
    rec.error = _check_count(rec.completion_tokens, cfg) or check_logprobs(content, cfg)
    return rec


def _check_count(n: int, cfg: LoadConfig) -> str | None:
    return None if n == cfg.max_tokens else f"{n} completion tokens, expected {cfg.max_tokens}"


Sender = Callable[[httpx.AsyncClient, LoadConfig, int], Awaitable[RequestRecord]]


async def run_load(
    cfg: LoadConfig, send: Sender | None = None, ready: Callable[[], None] | None = None
) -> LoadResult:
    """Run one closed-loop load and return its measurements. Requests that fail still count in
    the wall time but not in tokens; `errors` says how many. `send` makes and checks one
    request (default: chat completions, streaming or not as `cfg` says). `ready` is called once
    every worker's client is built, just before the clock starts."""
    if min(cfg.processes, cfg.concurrency, cfg.requests) > 1:
        return await asyncio.to_thread(_run_processes, cfg, send)
    next_index = cfg.first_index
    end_index = cfg.first_index + cfg.requests
    records: list[RequestRecord] = []
    send = send or (_stream if cfg.stream else _complete)
    # One connection per worker: the client-side pool must never be what limits concurrency.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    # Built before the clock starts: with certificate checks on, each client loads the CA
    # bundle (~30 ms), which staggered a wave's first requests by that much per worker.
    plain = cfg.base_url.startswith("http://")
    if cfg.logprobs_format != "openai":  # the compact form's decoder, imported off the clock
        from omlx_logprobs.logprobs.columnar import decode_block  # noqa: F401
    clients = [
        httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout, verify=not plain)
        for _ in range(min(cfg.concurrency, cfg.requests))
    ]

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal next_index
        async with c:
            while next_index < end_index:
                index = next_index
                next_index += 1  # single-threaded event loop: no lock needed
                t0 = time.perf_counter()
                try:
                    rec = await send(c, cfg, index)
                    if cfg.parse_in_loop and rec.body is not None:
                        check_body(rec, cfg)
                    records.append(replace(rec, sent_at=t0, done_at=time.perf_counter()))
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                    lat = time.perf_counter() - t0
                    err = f"{type(e).__name__}: {e}"
                    records.append(RequestRecord(lat, error=err, sent_at=t0, done_at=t0 + lat))

    if ready is not None:
        ready()
    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    wall = time.perf_counter() - start
    for rec in records:
        if rec.body is not None:
            check_body(rec, cfg)
    return summarize(cfg, records, wall)


def _shares(cfg: LoadConfig) -> list[LoadConfig]:
    """Each client process's workers and requests, request indices disjoint and in order."""
    n = min(cfg.processes, cfg.concurrency, cfg.requests)
    shares, first = [], cfg.first_index
    for i in range(n):
        c = cfg.concurrency // n + (i < cfg.concurrency % n)
        r = cfg.requests // n + (i < cfg.requests % n)
        shares.append(replace(cfg, concurrency=c, requests=r, processes=1, first_index=first))
        first += r
    return shares


def _child(cfg: LoadConfig, send: Sender | None, start: Any, out: Any) -> None:
    began: list[float] = []

    def ready() -> None:  # every process has built its clients before any request is sent
        start.wait()
        began.append(time.perf_counter())  # CLOCK_MONOTONIC: comparable between processes

    res = asyncio.run(run_load(cfg, send, ready))
    out.put((began[0], began[0] + res.wall_s, res))  # the clock stopped before the checks


def _run_processes(cfg: LoadConfig, send: Sender | None) -> LoadResult:
    """`run_load` over several client processes started together; wall time from the first
    start to the last end. `send` must be a module-level function (it is pickled)."""
    ctx = mp.get_context("spawn")
    shares = _shares(cfg)
    start, out = ctx.Barrier(len(shares)), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(c, send, start, out)) for c in shares]
    for p in procs:
        p.start()
    done: list[tuple[float, float, LoadResult]] = []
    while len(done) < len(procs):
        try:
            done.append(out.get(timeout=1.0))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a load generator process failed") from None
    for p in procs:
        p.join()
    wall = max(d[1] for d in done) - min(d[0] for d in done)
    return summarize(cfg, [r for d in done for r in d[2].records], wall)


def summarize(cfg: LoadConfig, records: list[RequestRecord], wall: float) -> LoadResult:
    good = [r for r in records if r.error is None]
    bad = [r for r in records if r.error is not None]
    lat = [r.latency_s for r in good]
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    tokens = sum(r.completion_tokens for r in good)
    prompt_tokens = sum(r.prompt_tokens for r in good)
    res = LoadResult(
        config=cfg,
        ok=len(good),
        errors=len(bad),
        wall_s=wall,
        completion_tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        prompt_tokens=prompt_tokens,
        prompt_tokens_per_s=prompt_tokens / wall if wall > 0 else 0.0,
        requests_per_s=len(good) / wall if wall > 0 else 0.0,
        latency_mean_s=sum(lat) / len(lat) if lat else float("nan"),
        latency_p50_s=percentile(lat, 0.5),
        latency_p90_s=percentile(lat, 0.9),
        error_samples=sorted({r.error for r in bad if r.error})[:5],
        records=records,
    )
    if cfg.stream and ttft:
        res.ttft_mean_s = sum(ttft) / len(ttft)
        res.ttft_p50_s = percentile(ttft, 0.5)
        res.ttft_p90_s = percentile(ttft, 0.9)
    return res


def merge(results: list[LoadResult]) -> LoadResult:
    """Several runs of one configuration as one: tokens over summed wall time, percentiles over
    all requests. The runs must not overlap in time."""
    records = [r for res in results for r in res.records]
    cfg = replace(results[0].config, requests=sum(res.config.requests for res in results))
    return summarize(cfg, records, sum(res.wall_s for res in results))


def parse_logprobs(value: str) -> int | None:
    if value == "off":
        return None
    k = int(value)
    if k < 0:  # above 20 needs the server's --max-logprobs
        raise argparse.ArgumentTypeError("--logprobs is off or a count >= 0")
    return k


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=parse_logprobs, default=None, metavar="off|K")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--processes", type=int, default=1, help="client processes")
    p.add_argument("--records", help="write every request's record here, a JSON line each")
    p.add_argument("--parse-in-loop", action="store_true", help="parse each body before the next")
    p.add_argument("--logprobs-format", default="openai", choices=["openai", "columnar", "base64"])
    p.add_argument("--json-schema", action="store_true", help="a JSON schema on every request")
    a = p.parse_args(argv)
    cfg = LoadConfig(
        base_url=a.base_url,
        model=a.model,
        concurrency=a.concurrency,
        requests=a.requests,
        max_tokens=a.max_tokens,
        logprobs=a.logprobs,
        stream=a.stream,
        prompt_words=a.prompt_words,
        temperature=a.temperature,
        seed=a.seed,
        timeout_s=a.timeout,
        processes=a.processes,
        parse_in_loop=a.parse_in_loop,
        logprobs_format=a.logprobs_format,
        json_schema=a.json_schema,
    )
    res = asyncio.run(run_load(cfg))
    print(json.dumps(res.to_json(), indent=2))
    if a.records:
        with open(a.records, "a") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in res.records)  # bodies: checked
    return 1 if res.errors else 0


if __name__ == "__main__":
    sys.exit(main())
