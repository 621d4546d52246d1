# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""What vLLM's token masks cost the step loop: the same greedy batch (random prompts, EOS
ignored, fixed length) with no mask, with `allowed_token_ids` (1,000 ids), with ten two-token
`bad_words` (decided on the device while the last token is in flight) and with `min_tokens`
holding EOS back the whole way, and with a strict JSON schema (bench/loadgen.py's, which no
answer completes within the budget). Tokens per second, best of `--rounds`; with `--profile`,
where the engine's time goes in the none and JSON runs (cProfile, top functions).

    python -m bench.experiments.mask_cost --batch 8 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from dataclasses import replace

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.types import Constraint, ConstraintKind, SamplingParams

from bench.loadgen import JSON_SCHEMA


def variants(vocab: int, max_tokens: int) -> dict[str, SamplingParams]:
    rng = random.Random(0)
    base = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    allowed = tuple(sorted(rng.sample(range(vocab), 1000)))
    words = tuple((rng.randrange(vocab), rng.randrange(vocab)) for _ in range(10))
    return {
        "none": base,
        "allowed_token_ids": replace(base, allowed_token_ids=allowed),
        "bad_words": replace(base, bad_words_ids=words),
        "min_tokens": replace(base, min_tokens=max_tokens),
        "json_schema": replace(
            base, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(JSON_SCHEMA))
        ),
    }


_GRAMMARS: dict[int, object] = {}


def run(m: LoadedModel, n: int, params: SamplingParams, prompt_len: int) -> float:
    rng = random.Random(n)
    cfg = EngineConfig(max_num_seqs=max(64, n))
    engine = Engine(m.model, m.vocab, m.eos_token_ids, cfg, tokenizer=m.tokenizer)
    # One llguidance tokenizer for every run (a server builds it once), outside the clock.
    engine.grammars = _GRAMMARS.setdefault(id(m), engine.grammars)
    seqs = [
        Sequence(f"m{i}", [rng.randrange(100, len(m.vocab) - 100) for _ in range(prompt_len)],
                 params)
        for i in range(n)
    ]  # fmt: skip
    t0 = time.perf_counter()
    for s in seqs:
        engine._constrain(s)  # as the inbox does: a matcher per constrained row
        engine.scheduler.add(s)
    while engine.has_work():
        engine.step()
    return sum(s.num_output for s in seqs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="mlx-lm dir or .gguf; default: embedded")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="+", default=None, help="some of the variants")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    m = load_model(a.model)
    print(f"device {mx.default_device()}, model {m.path}", file=sys.stderr)
    cases = variants(len(m.vocab), a.max_tokens)
    if a.only:
        cases = {k: v for k, v in cases.items() if k in a.only}
    for params in cases.values():  # warm-up (the JSON grammar's tokenizer is built here)
        run(m, 2, params, a.prompt_len)
    if a.profile:
        for name in ("none", "json_schema"):
            prof = cProfile.Profile()
            prof.runcall(run, m, a.batch[0], cases[name], a.prompt_len)
            print(f"== {name}, batch {a.batch[0]}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        return 0
    for n in a.batch:
        for name, params in cases.items():
            best = max(run(m, n, params, a.prompt_len) for _ in range(a.rounds))
            print(f"batch {n:3d}  {name:18s} {best:8.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
