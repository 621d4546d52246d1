"""Where a speculating server's greedy answer parts from the plain one's: the same chat request
(greedy, top 5) to a server with `--speculate off` and one with `--speculate lookup`; over the
tokens both share, the largest difference of the chosen token's logprob and of the top 5; at
the first token that differs, both runs' two best candidates there. In float32 (the CPU) the
answers are equal (tests/engine/test_speculation.py); in bfloat16 a verify forward of 9
positions sums in another order than a one-token step, which can swap two near-tied tokens.

    python3 -m bench.experiments.spec_divergence --model DIR [--prompt chat|repeat|edit]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from bench.server import free_port, omlx_command, start_server
from bench.speculation import PROMPTS


def answer(variant: str, model_dir: str | None, prompt: str, tokens: int) -> list[dict[str, Any]]:
    port = free_port()
    server = start_server(omlx_command(port, model_dir, 8) + ["--speculate", variant], port)
    try:
        model = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
        r = httpx.post(
            server.base_url + "/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 5,
            },
            timeout=1200,
        )
        r.raise_for_status()
        return list(r.json()["choices"][0]["logprobs"]["content"])
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", choices=tuple(PROMPTS), default="chat")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    plain = answer("off", args.model, PROMPTS[args.prompt], args.max_tokens)
    spec = answer("lookup", args.model, PROMPTS[args.prompt], args.max_tokens)
    same, chosen, top = 0, 0.0, 0.0
    for a, b in zip(plain, spec, strict=False):
        if a["token"] != b["token"]:
            break
        same += 1
        chosen = max(chosen, abs(a["logprob"] - b["logprob"]))
        ta = {t["token"]: t["logprob"] for t in a["top_logprobs"]}
        for t in b["top_logprobs"]:
            if t["token"] in ta:
                top = max(top, abs(ta[t["token"]] - t["logprob"]))
    out: dict[str, Any] = {"tokens": len(plain), "same_prefix": same, "chosen": chosen, "top5": top}
    if same < min(len(plain), len(spec)):
        out["plain_top2"] = [(t["token"], t["logprob"]) for t in plain[same]["top_logprobs"][:2]]
        out["spec_top2"] = [(t["token"], t["logprob"]) for t in spec[same]["top_logprobs"][:2]]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
