"""Speculative decoding in-process (no HTTP): one stream's decode tokens/s with logprobs (top
20, greedy), speculation off against on, alternating rounds in one process (a shared box's
load moves both alike). Tasks: an editing request whose prediction is the model's own answer
with a token changed every 40 (what a client's mostly-right prediction gives), a repeat-the-file
request (prompt lookup) and free chat (lookup; and a draft model with --draft-model).

    .venv/bin/python bench/experiments/spec_engine.py --rounds 2 --max-tokens 128
"""

# ruff: noqa: I001, E402  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import omlx_logprobs  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.transport.client import EngineClient, ThreadTransport
from omlx_logprobs.types import EngineRequest, SamplingParams
from speculation import PROMPTS


def run(model: LoadedModel, cfg: EngineConfig, prompt: list[int], sp: SamplingParams) -> tuple[float, list[int], int]:  # noqa: E501
    """(decode tokens/s, the output ids, accepted prediction tokens)."""
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, tokenizer=model.tokenizer)
    client = EngineClient(ThreadTransport(engine))
    client.start()

    async def go() -> tuple[float, list[int], int]:
        handle = client.submit(EngineRequest("r", prompt, sp, stream=True))
        slot = handle.choices[0]
        times, ids, acc = [], [], 0
        while True:
            out = await slot.get()
            if len(out.token_ids):
                times.append((time.perf_counter(), len(out.token_ids)))
                ids += out.token_ids.tolist()
            acc = out.accepted_prediction_tokens
            if out.finished:
                break
        n = sum(k for _, k in times[1:])
        return n / (times[-1][0] - times[0][0]), ids, acc

    try:
        return asyncio.run(go())
    finally:
        client.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    args = ap.parse_args()
    mlx_environment()
    model = load_model(args.model)
    tok = model.tokenizer

    def chat(text: str) -> list[int]:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tok.encode(rendered, add_special_tokens=False))

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=True, top_logprobs=20)
    off = EngineConfig(speculate="off", prefix_cache_mib=0)
    k = args.num_draft_tokens
    cases = {
        "edit/prediction": ("edit", replace(off, speculate="prediction", num_draft_tokens=k)),
        "repeat/lookup": ("repeat", replace(off, speculate="lookup", num_draft_tokens=k)),
        "chat/lookup": ("chat", replace(off, speculate="lookup", num_draft_tokens=k)),
    }
    if args.draft_model:
        cfg = replace(off, speculate="draft", draft_model=args.draft_model, num_draft_tokens=k)
        cases["chat/draft"] = ("chat", cfg)
    for name, (task, cfg) in cases.items():
        prompt = chat(PROMPTS[task])
        rates: dict[str, list[float]] = {"off": [], "on": []}
        base_ids: list[int] = []
        for _ in range(args.rounds):
            r, base_ids, _ = run(model, off, prompt, sp)
            rates["off"].append(r)
            ask = sp
            if task == "edit":
                pred = [t if i % 40 != 20 else 13 for i, t in enumerate(base_ids)]
                ask = replace(sp, prediction=tuple(pred))
            r, ids, acc = run(model, cfg, prompt, ask)
            rates["on"].append(r)
            assert ids == base_ids, f"{name}: speculation changed the answer"
        a, b = statistics.median(rates["off"]), statistics.median(rates["on"])
        print(f"{name:16s} off {a:6.2f} tok/s  on {b:6.2f} tok/s  {b / a:4.2f}x  "
              f"(rounds off {rates['off']}, on {rates['on']}; accepted {acc})", flush=True)


if __name__ == "__main__":
    main()
