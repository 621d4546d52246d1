"""One stream on bare mlx-lm (`stream_generate`, greedy, EOS banned so every run is as long):
the per-token latency after the first token, median over runs; the floor a server's one stream
is held to (bench/experiments/gpu_one_stream.sh).

    python3 -m bench.experiments.bare_stream --model $R8Q --tokens 128 --runs 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm import load, stream_generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    model, tok = load(a.model)
    eos = list(tok.eos_token_ids)

    def no_eos(_: mx.array, logits: mx.array) -> mx.array:
        logits[:, eos] = -float("inf")
        return logits

    per_token = []
    for run in range(a.runs + 1):  # the first builds the kernels: not counted
        msgs = [{"role": "user", "content": f"Request {run}: tell me about rivers and stones"}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
        stamps = []
        for _ in stream_generate(model, tok, prompt, a.tokens, logits_processors=[no_eos]):
            stamps.append(time.perf_counter())
        if run:
            per_token.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
    print(f"bare mlx-lm stream_generate: {statistics.median(per_token):.3f} ms per token "
          f"(runs {' '.join(f'{x:.3f}' for x in per_token)})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
