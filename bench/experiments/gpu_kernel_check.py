# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""On a GPU host: the engine with the CUDA step kernel against the engine with MLX ops, on a
real model and a mixed batch, then the kernel's rows against a full forward pass.

    python -m bench.experiments.gpu_kernel_check --model DIR

Half the prompts share a 30-token start (prefix caching on the device path). Same tokens
everywhere; the same logprobs and ranks bit for bit; the same top lists (ids may
differ only among equal logprobs); every greedy row's entries within 1e-3 of a float32
log-softmax of one uncached forward pass (bfloat16 models round differently in a batch).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import omlx_logprobs  # noqa: F401
import mlx.core as mx
import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.logprobs.extractor import DeviceExtractor
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.types import LogprobsMode, SamplingParams


def params() -> list[SamplingParams]:
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    return [
        replace(base, top_logprobs=20),
        replace(base, top_logprobs=5, temperature=0.8, top_p=0.9, seed=3),
        replace(
            base,
            top_logprobs=5,
            temperature=0.7,
            top_k=40,
            seed=4,
            logprobs_mode=LogprobsMode.PROCESSED,
        ),
        replace(base, top_logprobs=0),
        replace(base, logprob_token_ids=(5, 17, 900)),
        replace(base, top_logprobs=3, logit_bias=((7, 5.0),)),
        replace(base, logprobs=False),
    ] * 3


def run(m: LoadedModel, fused: bool) -> list[Sequence]:
    engine = Engine(m.model, m.vocab, m.eos_token_ids, EngineConfig(max_num_seqs=64))
    engine.runner.extractor = engine.runner.prefill.extractor = DeviceExtractor(fused)
    rng = np.random.default_rng(0)
    system = rng.integers(100, len(m.vocab) - 100, 30).tolist()
    seqs = []
    for i, p in enumerate(params()):
        prompt = rng.integers(100, len(m.vocab) - 100, int(rng.integers(8, 40))).tolist()
        prompt = system + prompt if i % 2 else prompt  # these start from a cached prefix
        seqs.append(Sequence(f"k{i}", prompt, p))
        engine.scheduler.add(seqs[-1])
    while engine.has_work():
        engine.step()
    return seqs


def reference(m: LoadedModel, ids: list[int]) -> np.ndarray:
    logits = np.array(m.model(mx.array([ids]))[0].astype(mx.float32), np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return (logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))).astype(np.float32)


def compare(a: LogprobStore, b: LogprobStore) -> None:
    assert list(a.token_ids) == list(b.token_ids)
    assert a.logprobs.tobytes() == b.logprobs.tobytes(), "logprobs differ"
    assert list(a.ranks) == list(b.ranks), "ranks differ"
    assert a.top_logprobs.tobytes() == b.top_logprobs.tobytes(), "top logprobs differ"
    if list(a.top_ids) != list(b.top_ids):  # only among exact ties
        ta, tb = np.array(a.top_logprobs), np.array(b.top_logprobs)
        diff = np.array(a.top_ids) != np.array(b.top_ids)
        assert np.array_equal(ta[diff], tb[diff]), "top ids differ beyond ties"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    a = ap.parse_args(argv)
    m = load_model(a.model)
    fused, ops = run(m, True), run(m, False)
    checked = 0
    for s, t in zip(fused, ops):
        assert list(s.output_ids) == list(t.output_ids), f"{s.request_id}: tokens differ"
        if s.store is not None and t.store is not None:
            compare(s.store, t.store)
        if s.params.logprobs and s.params.temperature == 0 and not s.params.logit_bias:
            out = list(s.output_ids)
            ref = reference(m, s.prompt_ids + out)[len(s.prompt_ids) - 1 : -1]
            assert s.store is not None
            for i, tok in enumerate(out):
                assert abs(s.store.logprobs[i] - ref[i, tok]) < 1e-3 * max(1, abs(ref[i, tok]))
            checked += 1
    cached = sum(s.cached_tokens > 0 for s in fused)
    assert cached, "no prompt started from a cached prefix"
    print(
        f"fused kernel == MLX ops on {len(fused)} requests ({cached} from a cached prefix); "
        f"{checked} against a full forward"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
