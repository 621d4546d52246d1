"""Speculative decoding in-process (no HTTP): one stream's decode tokens/s with logprobs (top
20, greedy), speculation off against on, alternating rounds in one process (a shared box's
load moves both alike). Tasks: an editing request whose prediction is the model's own answer
with a token changed every 40 (what a client's mostly-right prediction gives), a repeat-the-file
request (prompt lookup) and free chat (lookup; and a draft model with --draft-model).

    .venv/bin/python -m bench.experiments.spec_engine --rounds 2 --max-tokens 128

`--phases` also prints, per case, the wall time of the speculator's phases (a proposal from the
draft model, a verify's launch, the parts of it, and its collection) and what its verify steps
drafted and emitted, for the request's first run in its engine and for a second one after it
(shapes and kernels first met in the first), with each phase's longest call. With
`--settle-drafts` each proposal is evaluated inside its timing, so that the draft model's device
time (a kernel or graph built at a new shape) counts in `propose` rather than in the verify's
wait; the drafts then no longer run on the device while the verify is built, so the rates are
lower than the engine's.
"""

# ruff: noqa: I001, E402  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter, defaultdict
from typing import Any
from dataclasses import replace

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import speculation, verify
from omlx_logprobs.logprobs.extractor import DeviceExtractor
from omlx_logprobs.runner.draft_model import DraftModel
from omlx_logprobs.runner.model_runner import ModelRunner
from omlx_logprobs.transport.client import EngineClient, ThreadTransport
from omlx_logprobs.types import EngineRequest, SamplingParams
from bench.speculation import CHATS, PROMPTS

from bench.experiments import clock


phases: dict[str, float] = defaultdict(float)
calls: dict[str, list[float]] = defaultdict(list)  # each call's ms
counts: Counter[str] = Counter()  # what the verify steps drafted and emitted, and rests


def timed(owner: Any, name: str, label: str | None = None) -> None:
    """Wrap owner.name so that its calls' wall time adds to phases[label or name]."""
    clock.timed(owner, name, phases, calls, label)


def settle_drafts() -> None:
    """Each proposal evaluated before it returns (`--settle-drafts`)."""
    propose = DraftModel.propose

    def settled(self: Any, *a: Any) -> Any:
        out = propose(self, *a)
        mx.eval(out)
        return out

    DraftModel.propose = settled  # type: ignore[method-assign]


def instrument(settle: bool) -> None:
    if settle:
        settle_drafts()
    timed(speculation.Speculator, "launch")
    timed(speculation.Speculator, "collect")
    timed(DraftModel, "propose")
    timed(speculation, "token_mask", "launch.mask")
    timed(speculation, "draw", "launch.draw")
    timed(verify, "positions", "launch.positions")
    timed(DeviceExtractor, "step", "extract")
    timed(ModelRunner, "queue")
    timed(ModelRunner, "forward_rows")
    score = speculation.Speculator._score

    def scored(self: Any, s: Any, emitted: int, drafted: int) -> None:
        counts["drafted"] += drafted
        counts["emitted"] += emitted
        counts["verifies"] += 1
        score(self, s, emitted, drafted)

    speculation.Speculator._score = scored  # type: ignore[method-assign]
    rest = speculation._Row.rest

    def rested(self: Any) -> None:
        counts["rests"] += 1
        rest(self)

    speculation._Row.rest = rested  # type: ignore[method-assign]


def report(name: str, tokens: int, rate: float) -> None:
    ms = {
        k: f"{v * 1e3:.0f} ms/{len(calls[k])} (longest {max(calls[k])})" for k, v in phases.items()
    }
    print(
        f"  {name}: {tokens} tokens, {rate:.1f} tok/s; {ms}; verifies {counts['verifies']}, "
        f"drafted {counts['drafted']}, emitted {counts['emitted']}, rests {counts['rests']}",
        flush=True,
    )
    phases.clear()
    calls.clear()
    counts.clear()


def run(
    model: LoadedModel, cfg: EngineConfig, prompt: list[int], sp: SamplingParams, again: str = ""
) -> tuple[float, list[int], int]:  # noqa: E501
    """(decode tokens/s, the output ids, accepted prediction tokens); with `again`, the request
    runs twice in the engine, the phases of each reported under that name."""
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, tokenizer=model.tokenizer)
    client = EngineClient(ThreadTransport(engine))
    client.start()

    async def one(rid: str) -> tuple[float, list[int], int]:
        handle = client.submit(EngineRequest(rid, prompt, sp, stream=True))
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

    async def go() -> tuple[float, list[int], int]:
        first = await one("r")
        if not again:
            return first
        report(f"{again}, first run", len(first[1]), first[0])
        second = await one("r2")
        report(f"{again}, again", len(second[1]), second[0])
        return second

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
    ap.add_argument("--cases", nargs="+", default=None, help="e.g. chat/draft (default: all)")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--settle-drafts", action="store_true", help="with --phases: see above")
    args = ap.parse_args()
    mlx_environment()
    if args.phases:
        instrument(args.settle_drafts)
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
        for i in (2, 3):  # bench/speculation.py's other free-chat requests ("chats")
            cases[f"chat{i}/draft"] = (f"chat{i}", cfg)
    texts = PROMPTS | {f"chat{i}": CHATS[i - 1] for i in (2, 3)}
    for name, (task, cfg) in cases.items():
        if args.cases and name not in args.cases:
            continue
        prompt = chat(texts[task])
        rates: dict[str, list[float]] = {"off": [], "on": []}
        base_ids: list[int] = []
        for _ in range(args.rounds):
            r, base_ids, _ = run(model, off, prompt, sp)
            rates["off"].append(r)
            phases.clear()
            ask = sp
            if task == "edit":
                pred = [t if i % 40 != 20 else 13 for i, t in enumerate(base_ids)]
                ask = replace(sp, prediction=tuple(pred))
            r, ids, acc = run(model, cfg, prompt, ask, name if args.phases else "")
            rates["on"].append(r)
            if ids != base_ids:  # bfloat16 near-ties may part them (docs/specs/speculation.md)
                at = next((i for i, (a, b) in enumerate(zip(ids, base_ids)) if a != b), None)
                print(f"  {name}: speculation's answer parts from the plain one at {at}")
        print(f"  {name} text: {tok.decode(ids[:40])!r}")
        a, b = statistics.median(rates["off"]), statistics.median(rates["on"])
        print(
            f"{name:16s} off {a:6.2f} tok/s  on {b:6.2f} tok/s  {b / a:4.2f}x  "
            f"(rounds off {rates['off']}, on {rates['on']}; accepted {acc})",
            flush=True,
        )


if __name__ == "__main__":
    main()
