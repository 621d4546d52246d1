"""When a streamed request's chunks reach the client, against the server's step trace: a warm-up
request, then free chat (bench/speculation.py's), each chunk's arrival (perf_counter, the
monotonic clock the server's OMLX_STEP_TRACE lines use) and tokens; with a server log, the
steps that ended within the chat request's stream and the last one's lead on the last chunk.

    python -m bench.experiments.stream_gaps --base http://127.0.0.1:8101/v1 --log SERVER_LOG
"""

from __future__ import annotations

import argparse
import json
import time
from statistics import median

import httpx

from bench.speculation import PROMPTS, WARMUP, body


def arrivals(base: str, req: dict, text: list[str] | None = None) -> list[tuple[float, int]]:
    """Each chunk's arrival time and tokens; the tokens' text appended to `text` if given."""
    out = []
    with httpx.stream("POST", base + "/chat/completions", json=req, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                content = (ch.get("logprobs") or {}).get("content") or []
                n = len(content)
                if text is not None:
                    text += [e["token"] for e in content]
                if n:
                    out.append((time.perf_counter(), n))
    return out


def rate(got: list[tuple[float, int]]) -> float:
    """Tokens/s after the first chunk (the time to first token left out)."""
    n = sum(k for _, k in got)
    return (n - got[0][1]) / max(got[-1][0] - got[0][0], 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    model = httpx.get(args.base + "/models").json()["data"][0]["id"]
    first = arrivals(args.base, body(model, WARMUP, args.max_tokens, None))
    print(f"warm-up (the server's first request): {rate(first):.1f} tok/s")
    text: list[str] = []
    got = arrivals(args.base, body(model, PROMPTS["chat"], args.max_tokens, None), text)
    t0, t1 = got[0][0], got[-1][0]
    n = sum(k for _, k in got)
    print(f"chat: {len(got)} chunks, {n} tokens, {rate(got):.1f} tok/s")
    print("  text:", repr("".join(text[:40])))
    print("  chunk gaps ms:", [round(1e3 * (b[0] - a[0]), 1) for a, b in zip(got, got[1:])])
    if args.log:
        steps = [[float(x) for x in ln.split("step-trace:")[1].split()]
                 for ln in open(args.log, errors="replace") if "step-trace:" in ln]  # fmt: skip
        within = [s for s in steps if t0 - 0.05 <= s[0] <= t1]
        inside = [s[0] for s in within]
        if within:
            # Medians over the stream's steps: the interval between step ends, the launch,
            # the completion and the wait on the device (stats.py's trace fields).
            gaps = [b - a for a, b in zip(inside, inside[1:])] or [0.0]
            print(
                f"  step medians ms: interval {1e3 * median(gaps):.2f}, launch "
                f"{median([s[1] for s in within]):.2f}, complete "
                f"{median([s[2] for s in within]):.2f}, queue {median([s[5] for s in within]):.2f}"
            )
        print(
            f"  steps ending within the stream: {len(inside)}; the last "
            f"{1e3 * (t1 - inside[-1]):.1f} ms before the last chunk"
            if inside
            else "  none"
        )


if __name__ == "__main__":
    main()
