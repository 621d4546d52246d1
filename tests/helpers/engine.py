"""The tiny test model's shape, encoding, an independent reference (one full forward pass, float32
log-softmax), running requests through a fresh engine, and the checks against that reference."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
from array import array
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient, ThreadTransport
from omlx_logprobs.types import (
    THINK_TAGS,
    EngineRequest,
    Entries,
    RequestOutput,
    SamplingParams,
    ThinkStart,
    ToolParsing,
)

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


class StoreView:
    """A block of entries read the way the engine's store was: flat columns and `top(i)`."""

    def __init__(self, e: Entries) -> None:
        self.entries = e
        self.k = e.k
        self.token_ids, self.logprobs, self.ranks = e.token_ids, e.logprobs, e.ranks
        self.top_ids, self.top_logprobs = e.top_ids.ravel(), e.top_logprobs.ravel()

    def __len__(self) -> int:
        return len(self.entries)

    def top(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.entries.top_ids[i], self.entries.top_logprobs[i]


class Record:
    """One choice of a request rebuilt from its outputs alone, as a client sees it: the ids,
    entries and finish the engine's own record held."""

    def __init__(self, req: EngineRequest, outputs: list[RequestOutput]) -> None:
        self.request_id, self.prompt_ids, self.params = req.request_id, req.prompt_ids, req.params
        self.outputs = outputs
        merged = functools.reduce(RequestOutput.merge, outputs)
        self.output_ids = array("i", merged.token_ids.tolist())
        self.num_output = len(merged.token_ids)
        self.store = StoreView(merged.logprobs) if merged.logprobs is not None else None
        prompt = merged.prompt_logprobs
        self.prompt_store = StoreView(prompt) if prompt is not None else None
        self.finish_reason, self.error = merged.finish_reason, merged.error
        self.cached_tokens = merged.cached_tokens


def client_of(engine: Engine) -> EngineClient:
    """The engine as the API reaches it: a client over a thread of this process, started."""
    client = EngineClient(ThreadTransport(engine))
    client.start()
    return client


async def collect_outputs(client: EngineClient, req: EngineRequest) -> list[list[RequestOutput]]:
    """Every output of each choice of `req`, in order, until each finishes."""
    handle = client.submit(req)

    async def choice(slot: Any) -> list[RequestOutput]:
        outs = [await slot.get()]
        while not outs[-1].finished:
            outs.append(await slot.get())
        return outs

    return list(await asyncio.gather(*[choice(c) for c in handle.choices]))


def run_requests(engine: Engine, reqs: list[EngineRequest]) -> list[Record]:
    """Submit these requests at once to an engine made by the caller (shut down after); each
    one's first choice as rebuilt from its outputs."""
    client = client_of(engine)

    async def main() -> list[list[list[RequestOutput]]]:
        return await asyncio.gather(*[collect_outputs(client, r) for r in reqs])

    try:
        outs = asyncio.run(main())
    finally:
        client.shutdown()
    return [Record(r, o[0]) for r, o in zip(reqs, outs)]


def run_engine(
    model: LoadedModel,
    requests: list[tuple[list[int], SamplingParams]],
    cfg: EngineConfig | None = None,
    thinks: list[ThinkStart] | None = None,
    tools: list[ToolParsing | None] | None = None,
    tags: list[tuple[str, str]] | None = None,
) -> list[tuple[Record, list[RequestOutput]]]:
    """Submit all requests at once (streamed) to a fresh engine; each one's record, rebuilt
    from its outputs, and the outputs."""
    engine = Engine(
        model.model,
        model.vocab,
        model.eos_token_ids,
        cfg or EngineConfig(),
        tokenizer=model.tokenizer,
    )
    return run_on(engine, requests, thinks, tools, tags)


def run_on(
    engine: Engine,
    requests: list[tuple[list[int], SamplingParams]],
    thinks: list[ThinkStart] | None = None,
    tools: list[ToolParsing | None] | None = None,
    tags: list[tuple[str, str]] | None = None,
) -> list[tuple[Record, list[RequestOutput]]]:
    """`run_engine` on an engine made by the caller (shut down after)."""
    client = client_of(engine)
    thinks = thinks or [ThinkStart.OFF] * len(requests)
    tools = tools or [None] * len(requests)
    tags = tags or [THINK_TAGS] * len(requests)
    reqs = [
        EngineRequest(f"r{i}", list(p), sp, think=t, stream=True, tools=tp, reasoning_tags=tg)
        for i, ((p, sp), t, tp, tg) in enumerate(zip(requests, thinks, tools, tags))
    ]

    async def main() -> list[list[list[RequestOutput]]]:
        return await asyncio.gather(*[collect_outputs(client, r) for r in reqs])

    try:
        outs = asyncio.run(main())
    finally:
        client.shutdown()
    return [(Record(r, o[0]), o[0]) for r, o in zip(reqs, outs)]


def check_against_reference(
    model: LoadedModel, prompt: list[int], seq: Any, k: int, tie: float = 0.0
) -> None:
    """Every entry of `seq` against a full forward pass; `tie`: ranks and top ids may differ
    where the reference has other logprobs within that distance (float rounding between a
    batched and a whole-sequence forward, for a model whose logprobs lie close together)."""
    out = list(seq.output_ids)
    ref = reference_logprobs(model, prompt + out)[len(prompt) - 1 : -1]
    store = seq.store
    if not isinstance(store, StoreView):  # the engine's own record (a test that steps it)
        store = StoreView(store.block(0, len(store)))
    assert len(store) == len(out)
    for i, tok in enumerate(out):
        row = ref[i]
        assert store.token_ids[i] == tok
        assert abs(store.logprobs[i] - row[tok]) < 1e-4
        if tie:
            lo, hi = np.sum(row > row[tok] + tie) + 1, np.sum(row >= row[tok] - tie)
            assert lo <= store.ranks[i] <= hi
        else:
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


def check_prompt_store(seq: Record, ref: np.ndarray, k: int) -> None:
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


def moved_copy(src: Path, out: Path, seed: int = 7, scale: float = 0.3) -> Path:
    """A copy of a model directory whose every weight moved by `scale` of its own standard
    deviation (seeded noise): the same model after a training step."""
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    old = mx.load(str(src / "model.safetensors"))
    assert isinstance(old, dict)
    keys = mx.random.split(mx.random.key(seed), len(old))
    new = {}
    for key, (name, w) in zip(keys, sorted(old.items())):
        new[name] = w + scale * mx.std(w) * mx.random.normal(w.shape, key=key)
    mx.save_safetensors(str(out / "model.safetensors"), new)
    return out


def tiny_model_dir(out: Path, tokenizer_dir: Path, seed: int = 1234) -> Path:
    """A 2-layer llama (TINY_CONFIG) with seeded random weights and the tokenizer files of
    `tokenizer_dir`, saved as an mlx-lm model directory."""
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(TINY_CONFIG))
    # Logits with a standard deviation near 1: neither flat nor one-hot, so sampling leaves the
    # argmax and ranks and top lists carry information.
    model.model.embed_tokens.weight = mx.random.normal((49152, 64)) * 0.15
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def completion_difference(choice: Any, prompt: list[int], ref: np.ndarray, k: int = 5) -> float:
    """A greedy legacy completion (`openai` client's choice, with `prompt_logprobs` and
    `return_token_ids`) against the reference's float32 logprobs of prompt + output: each
    output token is the argmax, each top list the reference's best k (1e-4); returns the worst
    logprob difference, prompt and output, for the caller's bound."""
    out = choice.model_extra["token_ids"]
    worst = 0.0
    for i, entry in enumerate(choice.model_extra["prompt_logprobs"][1:], start=1):
        worst = max(worst, abs(entry[str(prompt[i])]["logprob"] - ref[i - 1][prompt[i]]))
    for j, lp in enumerate(choice.logprobs.token_logprobs):
        row = ref[len(prompt) - 1 + j]
        assert out[j] == int(np.argmax(row))  # greedy
        worst = max(worst, abs(lp - row[out[j]]))
        top = sorted(choice.logprobs.top_logprobs[j].values(), reverse=True)
        np.testing.assert_allclose(top, np.sort(row)[::-1][:k], atol=1e-4)
    print(f"max |logprob difference| {worst:.2e}")
    return worst


def count_verifies(monkeypatch: Any) -> list[int]:
    """Tokens each speculative step emits, appended as the steps are collected (Speculator's
    `collect` wrapped for the test)."""
    from omlx_logprobs.runner.speculation import Speculator

    counts: list[int] = []
    collect = Speculator.collect

    def counting(self: Speculator, runner: Any, step: Any, spec: Any) -> Any:
        result = collect(self, runner, step, spec)
        counts.append(len(result.seqs))
        return result

    monkeypatch.setattr(Speculator, "collect", counting)
    return counts
