"""lm-eval-style multiple choice against two servers, the prefix cache on and off: each question
is one context of `--context-words` words and four continuations, all four scored at once.

Three forms of the same work (each question's context its own, so no form finds another's):
- `batch`: one `/v1/completions` request with the four prompts as a list, `echo`, `logprobs: 1`,
  `max_tokens: 1` (what lm-evaluation-harness's `local-completions` sends with a batch size);
- `concurrent`: the four as four concurrent `/v1/completions` requests (its `num_concurrent`);
- `chat`: four concurrent `/v1/chat/completions` requests with `prompt_logprobs: 1`.
Reported per form: the seconds for all questions on each server (the servers alternate per
question), off / on, the prompt tokens served from the cache, and the largest difference of a
prompt logprob between the two servers.

    .venv/bin/python -m bench.experiments.multiple_choice --questions 3   # CPU, embedded model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench.loadgen import WORDS
from bench.server import Server, free_port, omlx_command, start_server

FORMS = ("batch", "concurrent", "chat")


def question(form: str, q: int, words: int) -> tuple[str, list[str]]:
    rng = random.Random(f"{form}-{q}")
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    context = f"Passage {form} {q}: {body}\nQuestion: which words come next?\nAnswer:"
    choices = [" " + " ".join(rng.choice(WORDS) for _ in range(3 + i)) for i in range(4)]
    return context, choices


def score(base: str, model: str, form: str, context: str, choices: list[str]) -> list[Any]:
    """The four continuations scored in `form`: (prompt logprobs, cached tokens) per choice."""
    c = httpx.Client(base_url=base, timeout=1200)
    legacy = {"model": model, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    if form == "batch":
        r = c.post("/completions", json={**legacy, "prompt": [context + x for x in choices]})
        r.raise_for_status()
        data = r.json()
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        return [(ch["logprobs"]["token_logprobs"][1:-1], cached) for ch in data["choices"]]

    def one(x: str) -> Any:
        if form == "concurrent":
            r = c.post("/completions", json={**legacy, "prompt": context + x})
        else:
            messages = [{"role": "user", "content": context + x}]
            r = c.post("/chat/completions", json={"model": model, "messages": messages,
                       "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
                       "return_token_ids": True})  # fmt: skip
        r.raise_for_status()
        data = r.json()
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        if form == "concurrent":
            return data["choices"][0]["logprobs"]["token_logprobs"][1:-1], cached
        ids, entries = data["prompt_token_ids"], data["prompt_logprobs"]
        return [entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], cached

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, choices))


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = "SmolLM2-135M-Instruct"
    servers: dict[str, Server] = {}
    for key, extra in (("on", []), ("off", ["--prefix-cache-mib", "0"])):
        port = free_port()
        servers[key] = start_server(omlx_command(port, None, 8) + extra, port)
    out: dict[str, Any] = {}
    try:
        for s in servers.values():  # warm-up
            score(s.base_url, model, "concurrent", *question("warm", 0, 50))
        for form in args.forms:
            times = {"on": 0.0, "off": 0.0}
            cached, worst = 0, 0.0
            for q in range(args.questions):
                ctx, choices = question(form, q, args.context_words)
                order = ["on", "off"] if q % 2 == 0 else ["off", "on"]
                got = {}
                for key in order:
                    t0 = time.perf_counter()
                    got[key] = score(servers[key].base_url, model, form, ctx, choices)
                    times[key] += time.perf_counter() - t0
                cached += got["on"][0][1] if form == "batch" else sum(x[1] for x in got["on"])
                for (a, _), (b, _) in zip(got["on"], got["off"]):
                    worst = max([worst, *(abs(x - y) for x, y in zip(a, b))])
            url = servers["on"].base_url.removesuffix("/v1") + "/tokenize"
            tokens = httpx.post(url, json={"model": model, "prompt": ctx}, timeout=60).json()
            tokens = tokens["count"]
            out[form] = {"on_s": round(times["on"], 2), "off_s": round(times["off"], 2),
                         "off/on": round(times["off"] / times["on"], 2), "cached": cached,
                         "context_tokens": tokens, "max_abs_diff": worst}  # fmt: skip
            print(json.dumps({form: out[form]}), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--context-words", type=int, default=1000)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    run(p.parse_args())


if __name__ == "__main__":
    main()
