"""Speculative decoding, one stream with logprobs (top 20, greedy): our server with speculation
off, with a prediction, with prompt lookup and with a draft model, and mlx-lm's server without
and with `--draft-model`, each on the same requests in one run; then c=32 throughput with and
without speculation. Servers run one at a time.

Requests (streamed; decode tokens/s = tokens after the first / time from the first to the last):
- edit: a ~130-line Python file and "rename a function, output the whole file"; its
  `prediction` is the file renamed (`--prediction file`: a model that follows the task) or the
  model's own greedy answer from the run without speculation with a token changed every 40
  (`--prediction self`: a random model, which follows no task; then it measures the mechanism
  with a prediction mostly right, as an editing client's is).
- repeat: the same file and "repeat it": prompt lookup's case.
- chat: free chat (a draft model's case); chats: three free-chat requests, one after the other
  (tokens/s over the three: a speculating run's rate follows its text, and in half precision
  near-ties part a speculating run's text from a plain one's at random places).
mlx-lm's server gets top_logprobs 10 (it refuses more). Each server first answers one other
request of as many tokens (`WARMUP`), unmeasured: the measured requests see a running server,
with the kernels and plans of its step shapes made (on MLX's CUDA backend, compiling them cost
the first request of a speculating server most of its time); `--no-warmup` leaves it out.

With `--pair SIZE` the model and draft model are bench/agreeing_pair.py's pair of that size
(built into bench/.cache once): no trained pair can be downloaded here, and random weights agree
with nothing. The run ends with the targets it reads: editing with a prediction at least 2x of
off, free chat with the draft model at least 1.4x, c=32 with speculation not lower than
without (within 5%, the run-to-run spread).

    .venv/bin/python -m bench.speculation                        # CPU: the embedded model
    python -m bench.speculation --pair 8b --max-tokens 256 --tasks edit repeat chats  # GPU host
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.server import free_port, mlx_lm_command, omlx_command, start_server

CACHE = Path(__file__).resolve().parent / ".cache"  # built models (bench/.gitignore)

TOP = 20
MLX_LM_TOP = 10  # mlx-lm's server refuses top_logprobs above 11


def source_file(lines: int = 130) -> str:
    out = ["import math", "", ""]
    for i in range(lines // 5):
        out += [f"def compute_{i}(x, y):", f"    total = x * {i} + y"]
        out += ["    return math.sqrt(total)", ""]
    return "\n".join(out)


FILE = source_file()
RENAMED = FILE.replace("compute_", "evaluate_")
PROMPTS = {
    "edit": "Rename every function `compute_N` to `evaluate_N` in this file and output the whole"
    f" file, nothing else:\n```python\n{FILE}\n```",
    "repeat": f"Repeat this file exactly, nothing else:\n```python\n{FILE}\n```",
    "chat": "Explain how a hash map works, with an example, in about 300 words.",
}
CHATS = [
    PROMPTS["chat"],
    "Tell me a short story about a lighthouse keeper and a storm.",
    "What are the pros and cons of remote work? Answer in a few paragraphs.",
]
WARMUP = "Describe the water cycle, step by step, in about 300 words."


def body(
    model: str, prompt: str, max_tokens: int, prediction: str | None, top: int = TOP
) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": top,
        "stream": True,
    }
    if top == TOP:  # ours: usage at the end of the stream
        b["stream_options"] = {"include_usage": True}
    if prediction is not None:
        b["prediction"] = {"type": "content", "content": prediction}
    return b


def stream(base: str, req: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: tokens, decode tokens/s, the text, usage if sent."""
    times: list[float] = []
    text, usage, n = "", None, 0
    with httpx.stream("POST", base + "/chat/completions", json=req, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                lp = (c.get("logprobs") or {}).get("content") or []
                got = len(lp) or int(bool((c.get("delta") or {}).get("content")))
                if got:
                    n += got
                    times.append(time.perf_counter())
                text += (c.get("delta") or {}).get("content") or ""
    rate = (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else 0.0
    return {"tokens": n, "tok_s": rate, "text": text, "usage": usage}


def measure(base: str, task: str, make: Any) -> dict[str, Any]:
    """`stream` for one task: its request (`make(prompt)` builds it), or the three of "chats"
    with their tokens and texts joined and tokens/s over the three."""
    if task != "chats":
        return stream(base, make(PROMPTS[task]))
    outs = [stream(base, make(p)) for p in CHATS]
    seconds = sum((o["tokens"] - 1) / o["tok_s"] for o in outs if o["tok_s"])
    tokens = sum(o["tokens"] for o in outs)
    rate = sum(o["tokens"] - 1 for o in outs) / seconds if seconds else 0.0
    text = "\n".join(o["text"] for o in outs)
    return {"tokens": tokens, "tok_s": rate, "text": text, "usage": outs[-1]["usage"]}


def self_prediction(text: str, every: int = 160) -> str:
    """The answer with a character changed every `every` characters: mostly right."""
    chars = list(text)
    for i in range(every // 2, len(chars), every):
        chars[i] = "#" if chars[i] != "#" else "!"
    return "".join(chars)


async def throughput(base: str, model: str, c: int, max_tokens: int) -> float:
    """c concurrent non-streamed chat requests (top 20, greedy): completion tokens/s."""
    async with httpx.AsyncClient(timeout=1200) as client:

        async def one(i: int) -> int:
            b = body(model, f"Request {i}: " + PROMPTS["chat"], max_tokens, None)
            b["stream"] = False
            r = await client.post(base + "/chat/completions", json=b)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*[one(i) for i in range(c)]))
        return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--pair", default=None, help="e.g. 8b: agreeing_pair.py's pair as both")
    ap.add_argument("--prediction", choices=("file", "self"), default="self")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32, help="0: no throughput runs")
    ap.add_argument("--tasks", nargs="+", default=["edit", "repeat", "chat"])
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--only-mlx-lm", action="store_true")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="ours: a subset of off, prediction, lookup, draft",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument(
        "--server-flags",
        default="",
        help="more flags for our servers, e.g. '--speculate-max-batch 32'",
    )
    args = ap.parse_args()
    if args.pair:
        from bench.agreeing_pair import ensure

        target, draft = ensure(args.pair, CACHE, Path(_embedded_dir()))
        args.model, args.draft_model = str(target), str(draft)
    k = ["--num-draft-tokens", str(args.num_draft_tokens)]
    ours: dict[str, list[str]] = {
        "off": ["--speculate", "off"],
        "prediction": ["--speculate", "prediction", *k],
        "lookup": ["--speculate", "lookup", *k],
    }
    if args.draft_model:
        ours["draft"] = ["--draft-model", args.draft_model, *k]
    if args.only_mlx_lm:
        ours = {}
    if args.variants:
        ours = {k: v for k, v in ours.items() if k in args.variants}
    results: dict[str, Any] = {"runs": {}, "throughput": {}}
    answers: dict[str, str] = {}
    for name, extra in ours.items():
        port = free_port()
        server = start_server(
            omlx_command(port, args.model, 64) + extra + args.server_flags.split(), port
        )
        base = server.base_url
        model = httpx.get(base + "/models").json()["data"][0]["id"]
        try:
            if not args.no_warmup:
                stream(base, body(model, WARMUP, args.max_tokens, None))
            for task in args.tasks:
                prediction = None
                if task == "edit" and name != "off":
                    own = answers[task]
                    prediction = RENAMED if args.prediction == "file" else self_prediction(own)
                ask = partial(body, model, max_tokens=args.max_tokens, prediction=prediction)
                out = measure(base, task, ask)
                answers.setdefault(task, out["text"])
                if out["text"] != answers[task]:
                    out["differs_from_off"] = True  # speculation must never change the answer
                details = (out["usage"] or {}).get("completion_tokens_details") or {}
                results["runs"][f"ours-{name}/{task}"] = {
                    "tokens": out["tokens"],
                    "tok_s": round(out["tok_s"], 2),
                    "accepted_prediction_tokens": details.get("accepted_prediction_tokens"),
                    "rejected_prediction_tokens": details.get("rejected_prediction_tokens"),
                    "same_answer": out["text"] == answers[task],
                }
                print(f"ours-{name:10s} {task:6s} {out['tok_s']:7.2f} tok/s", flush=True)
            if name in ("off", "lookup", "draft") and args.concurrency:
                asyncio.run(throughput(base, model, args.concurrency, 16))  # batch shapes compiled
                tput = asyncio.run(throughput(base, model, args.concurrency, 128))
                results["throughput"][f"ours-{name}"] = round(tput, 1)
                print(f"ours-{name:10s} c={args.concurrency} {tput:7.1f} tok/s", flush=True)
        finally:
            server.stop()
    if not args.no_mlx_lm:
        model_dir = args.model or _embedded_dir()
        variants = {"mlx-lm": []} | (
            {"mlx-lm-draft": ["--draft-model", args.draft_model, *k]} if args.draft_model else {}
        )
        for name, extra in variants.items():
            port = free_port()
            server = start_server(mlx_lm_command(port, model_dir, 1) + extra, port, "/v1/models")
            try:
                if not args.no_warmup:
                    stream(
                        server.base_url, body(model_dir, WARMUP, args.max_tokens, None, MLX_LM_TOP)
                    )
                for task in args.tasks:
                    out = measure(
                        server.base_url,
                        task,
                        partial(
                            body,
                            model_dir,
                            max_tokens=args.max_tokens,
                            prediction=None,
                            top=MLX_LM_TOP,
                        ),
                    )
                    results["runs"][f"{name}/{task}"] = {
                        "tokens": out["tokens"],
                        "tok_s": round(out["tok_s"], 2),
                    }
                    print(f"{name:15s} {task:6s} {out['tok_s']:7.2f} tok/s", flush=True)
            finally:
                server.stop()
    results["targets"] = targets(results)
    for line in results["targets"]:
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def targets(results: dict[str, Any]) -> list[str]:
    """Each target the run can read, its ratio and whether it is met."""
    runs, tput = results["runs"], results["throughput"]
    lines = []

    def ratio(name: str, variant: str, task: str, goal: float) -> None:
        on, off = runs.get(f"ours-{variant}/{task}"), runs.get(f"ours-off/{task}")
        if on and off and off["tok_s"]:
            r = on["tok_s"] / off["tok_s"]
            lines.append(f"target: {name}: {r:.2f}x of off (goal {goal}x): {_met(r >= goal)}")

    ratio("editing with a prediction", "prediction", "edit", 2.0)
    for task in ("chats", "chat"):
        ratio(f"free chat ({task}) with the draft model", "draft", task, 1.4)
    for variant in ("lookup", "draft"):
        on, off = tput.get(f"ours-{variant}"), tput.get("ours-off")
        if on and off:
            r = on / off
            met = _met(r >= 0.95)
            lines.append(f"target: throughput with {variant}: {r:.2f}x of off (goal 0.95x): {met}")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def _embedded_dir() -> str:
    from omlx_logprobs.models.embedded import ensure_embedded_model

    return str(ensure_embedded_model())


if __name__ == "__main__":
    main()
