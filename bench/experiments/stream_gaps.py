"""When a streamed request's chunks reach the client, against the server's step trace: a warm-up
request, then free chat (bench/speculation.py's), each chunk's arrival (perf_counter, the
monotonic clock the server's OMLX_STEP_TRACE lines use) and tokens; with a server log, the
steps that ended within the chat request's stream and the last one's lead on the last chunk.

    python bench/experiments/stream_gaps.py --base http://127.0.0.1:8101/v1 --log SERVER_LOG
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculation import PROMPTS, WARMUP, body  # noqa: E402


def arrivals(base: str, req: dict) -> list[tuple[float, int]]:
    out = []
    with httpx.stream("POST", base + "/chat/completions", json=req, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                n = len((ch.get("logprobs") or {}).get("content") or [])
                if n:
                    out.append((time.perf_counter(), n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    model = httpx.get(args.base + "/models").json()["data"][0]["id"]
    arrivals(args.base, body(model, WARMUP, args.max_tokens, None))
    got = arrivals(args.base, body(model, PROMPTS["chat"], args.max_tokens, None))
    t0, t1 = got[0][0], got[-1][0]
    n = sum(k for _, k in got)
    print(f"chat: {len(got)} chunks, {n} tokens, {(n - got[0][1]) / (t1 - t0):.1f} tok/s")
    print("  chunk gaps ms:", [round(1e3 * (b[0] - a[0]), 1) for a, b in zip(got, got[1:])])
    if args.log:
        ends = [float(ln.split("step-trace:")[1].split()[0])
                for ln in open(args.log, errors="replace") if "step-trace:" in ln]  # fmt: skip
        inside = [e for e in ends if t0 - 0.05 <= e <= t1]
        print(
            f"  steps ending within the stream: {len(inside)}; the last "
            f"{1e3 * (t1 - inside[-1]):.1f} ms before the last chunk"
            if inside
            else "  none"
        )


if __name__ == "__main__":
    main()
