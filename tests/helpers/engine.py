"""The tiny test model's shape, encoding, an independent reference (one full forward pass, float32
log-softmax), running requests through a fresh engine, and the checks against that reference."""

from __future__ import annotations

import asyncio
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.parsing.thinking import ThinkStart
from omlx_logprobs.types import RequestOutput, SamplingParams

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "eos_token_id": [2, 0],
}


def encode(model: LoadedModel, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def reference_logprobs(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: one full forward pass with no cache and no batch, its float32 logits'
    log-softmax taken in float64 (MLX's CPU logsumexp is off by up to ~1e-4 over 49k entries)."""
    logits = np.array(model.model(mx.array([ids]))[0].astype(mx.float32), np.float64)
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return (logits - lse).astype(np.float32)


async def collect_outputs(engine: Engine, seq: Sequence) -> list[RequestOutput]:
    handle = engine.add_request(seq, asyncio.get_running_loop())
    outs = [await handle.collector.get()]
    while not outs[-1].finished:
        outs.append(await handle.collector.get())
    return outs


def run_engine(
    model: LoadedModel,
    requests: list[tuple[list[int], SamplingParams]],
    cfg: EngineConfig | None = None,
    thinks: list[ThinkStart] | None = None,
) -> list[tuple[Sequence, list[RequestOutput]]]:
    """Submit all requests at once to a fresh engine; return each one's record and outputs."""
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg or EngineConfig())
    engine.start()
    thinks = thinks or [ThinkStart.OFF] * len(requests)
    seqs = [
        Sequence(f"r{i}", list(p), sp, t) for i, ((p, sp), t) in enumerate(zip(requests, thinks))
    ]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[collect_outputs(engine, s) for s in seqs])

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    return list(zip(seqs, outs))


def check_against_reference(model: LoadedModel, prompt: list[int], seq: Any, k: int) -> None:
    out = list(seq.output_ids)
    ref = reference_logprobs(model, prompt + out)[len(prompt) - 1 : -1]
    store = seq.store
    assert len(store) == len(out)
    for i, tok in enumerate(out):
        row = ref[i]
        assert store.token_ids[i] == tok
        assert abs(store.logprobs[i] - row[tok]) < 1e-4
        assert store.ranks[i] == int(np.sum(row >= row[tok]))
        if k:
            ids, lps = store.top(i)
            want = np.argsort(-row, kind="stable")[:k]
            np.testing.assert_allclose(np.array(lps), row[want], atol=1e-4)
            assert list(lps) == sorted(lps, reverse=True)
            assert len(set(ids)) == k
            # ids equal the reference's top k up to ties within float noise
            for got, exp in zip(ids, want):
                assert got == exp or abs(row[got] - row[exp]) < 1e-4


def check_prompt_store(seq: Sequence, ref: np.ndarray, k: int) -> None:
    """Prompt position i (1..len-1) against row i-1 of a full forward pass."""
    store, prompt = seq.prompt_store, seq.prompt_ids
    assert store is not None and len(store) == len(prompt) - 1
    for i in range(1, len(prompt)):
        row, tok = ref[i - 1], prompt[i]
        assert store.token_ids[i - 1] == tok
        assert abs(store.logprobs[i - 1] - row[tok]) < 1e-4
        # Rank up to near-ties: the batched forward and the reference differ by float rounding,
        # and over hundreds of positions some token sits within 1e-5 of another.
        lo, hi = np.sum(row > row[tok] + 1e-5), np.sum(row >= row[tok] - 1e-5)
        assert lo <= store.ranks[i - 1] <= hi
        if k:
            ids, lps = store.top(i - 1)
            want = np.sort(row)[::-1][:k]
            np.testing.assert_allclose(np.array(lps), want, atol=1e-4)
            np.testing.assert_allclose(row[np.array(ids)], np.array(lps), atol=1e-4)
