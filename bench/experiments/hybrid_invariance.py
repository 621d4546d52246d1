"""A conversation on each hybrid family from its kept states against the cache off: four turns,
each the last turn's prompt, answer and a new message (top 5, greedy, float32), the largest
difference of any chosen or top-list logprob, and the tokens each turn took from the cache.

    .venv/bin/python -m bench.experiments.hybrid_invariance

The families' tiny seeded random models are the tests' (tests/helpers/families.py).
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import tempfile
from pathlib import Path

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.commands import Submit
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model, resolve_model_path
from omlx_logprobs.types import EngineRequest, SamplingParams
from tests.helpers.families import build_family

FAMILIES = [
    "qwen3_next",
    "qwen3_5",
    "lfm2",
    "granitemoehybrid",
    "falcon_h1",
    "nemotron_h",
    "mamba2",
]
PARAMS = SamplingParams(
    max_tokens=16, temperature=0, logprobs=True, top_logprobs=5, ignore_eos=True
)


def turn(engine: Engine, rid: str, ids: list[int]) -> tuple[list[int], np.ndarray, int]:
    """One request to completion: its tokens, its chosen and top logprobs, its cached tokens."""
    engine.post(Submit(EngineRequest(rid, ids, PARAMS, stream=True)))
    engine._drain_inbox()
    [seq] = engine._live[rid]
    while engine.has_work():
        engine.step()
        engine.flush()
    block = seq.store.block(0, len(seq.store))
    values = np.concatenate(
        [np.asarray(block.logprobs)[:, None], np.asarray(block.top_logprobs)], 1
    )
    return list(seq.output_ids), values, seq.cached_tokens


def conversation(model: LoadedModel) -> tuple[float, list[int]]:
    on, off = (
        Engine(model.model, model.vocab, model.eos_token_ids, EngineConfig(prefix_cache_mib=mib))
        for mib in (64, 0)
    )
    ids = model.tokenizer.encode("You are a terse assistant. " * 20 + "User: hello\n")
    worst, cached = 0.0, []
    for t in range(4):
        a, va, c = turn(on, f"on{t}", ids)
        b, vb, _ = turn(off, f"off{t}", ids)
        assert a == b, "the tokens differ"
        worst, cached = max(worst, float(np.abs(va - vb).max())), cached + [c]
        ids = ids + a + model.tokenizer.encode(f"\nUser: and {t}?\n")
    return worst, cached


def main() -> None:
    tokenizer = Path(resolve_model_path(None)[0])
    print("| family | largest difference, cache on / off | cached tokens, turns 1-4 |")
    print("|---|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            model = load_model(str(build_family(name, Path(tmp) / name, tokenizer)))
            worst, cached = conversation(model)
            print(f"| {name} | {worst:.1e} | {', '.join(map(str, cached))} |", flush=True)


if __name__ == "__main__":
    main()
