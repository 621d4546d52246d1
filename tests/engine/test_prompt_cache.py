"""Prompt logprobs from the prefix cache: scoring requests that share a context (lm-eval's
multiple choice: one context, several continuations) take the context's keys, values and prompt
entries from the first one kept, and equal an engine with the cache off (within the invariance
tolerance of docs/specs/logprobs.md) and a full forward pass (1e-4), with `cached_tokens`
exactly the tokens taken from the cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import WeightUpdate
from omlx_logprobs.engine.commands import UpdateWeights
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import plan
from omlx_logprobs.types import SamplingParams
from tests.engine.test_conversation_cache import Chat
from tests.helpers.engine import (
    Record,
    check_prompt_store,
    encode,
    moved_copy,
    reference_logprobs,
    run_engine,
)

# docs/specs/logprobs.md, "Prefix caching": cache on against off, float32 on the CPU.
CHOSEN_TOL, TOP_TOL = 1.3e-5, 2.9e-5

CONTEXT = "Question: The quick brown fox jumps over the lazy dog. Which animal jumps?\n" * 6
# Three tokens each, each its own first token: every prompt shares exactly the context.
CHOICES = [" the red fox", " a blue cat", " one old dog", " two big pigs"]


def prompts(model: LoadedModel, context: str = CONTEXT) -> tuple[list[int], list[list[int]]]:
    ctx = encode(model, context + "Answer:")
    out = [ctx + encode(model, c) for c in CHOICES]
    assert len({len(p) for p in out}) == 1 and len({p[len(ctx)] for p in out}) == len(out)
    return ctx, out


def scoring(k: int = 5, max_tokens: int = 0, ids: list[int] | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, prompt_logprobs=k, logprob_token_ids=tuple(ids or ()),
        logprobs=max_tokens > 0, ignore_eos=True,
    )  # fmt: skip


def same_entries(on: Record, off: Record) -> None:
    """Cache on against off: the same tokens, each entry within the invariance tolerance, top
    ids the same up to near-ties."""
    a, b = on.prompt_store, off.prompt_store
    assert a is not None and b is not None and len(a) == len(b)
    assert list(a.token_ids) == list(b.token_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=CHOSEN_TOL, rtol=0)
    np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=TOP_TOL, rtol=0)
    for i in np.flatnonzero(a.top_ids != b.top_ids):
        assert abs(a.top_logprobs[i] - b.top_logprobs[i]) <= TOP_TOL


@pytest.mark.parametrize(
    "together,chunk,max_tokens,gpu_path",
    [(False, 64, 0, False), (True, 512, 0, False), (True, 64, 1, False), (True, 512, 1, True)],
    ids=["one-by-one-chunked", "together-whole", "together-chunked-one-token", "gpu-path"],
)
def test_scoring_a_shared_context_equals_scoring_without_the_cache(
    tiny: LoadedModel,
    together: bool,
    chunk: int,
    max_tokens: int,
    gpu_path: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four continuations of one context, sent one by one or together (lm-eval's batch): the
    first computes every position, the others take the context (all but its last token, whose
    entry needs the logits of the token before) from it. Chunked (64) the first prompt goes in
    three steps and is kept at its last; `max_tokens` 1, as lm-eval asks, keeps it when its
    token is generated. Sent together, the later ones wait a step for it. `gpu_path`: entries
    extracted as on a device, steps processed on a second thread (a step carrying first tokens
    is processed before the next launch, so the wait still finds the entries)."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", gpu_path)
    ctx, ps = prompts(tiny)
    params = scoring(5, max_tokens)
    on = Chat(tiny, EngineConfig(prefill_chunk=chunk, prefix_cache_mib=64))
    off = Chat(tiny, EngineConfig(prefill_chunk=chunk, prefix_cache_mib=0))
    try:
        if together:
            got, want = on.send(ps, params), off.send(ps, params)
        else:
            got = [on.send([p], params)[0] for p in ps]
            want = [off.send([p], params)[0] for p in ps]
    finally:
        on.client.shutdown()
        off.client.shutdown()
    # On a GPU a group's width is rounded up: its left padding covers part of the kept start.
    start = len(ctx) - 1
    start -= -(len(ps[0]) - start) % plan.GPU_PREFILL_ALIGN if gpu_path else 0
    assert [r.cached_tokens for r in got] == [0] + [start] * 3
    for (_, tokens), kept in on.engine.runner.prefixes.entries.items():  # whole, never cut
        assert all(k.shape[2] == len(tokens) for k in kept.keys + kept.values)
    for p, r, ref in zip(ps, got, want):
        assert r.error is None and ref.cached_tokens == 0
        same_entries(r, ref)
        full = reference_logprobs(tiny, p + list(r.output_ids))
        check_prompt_store(r, full, 5)
        if max_tokens:  # the generated token is the argmax after the whole prompt
            assert list(r.output_ids) == list(ref.output_ids) == [int(np.argmax(full[len(p) - 1]))]
            assert abs(r.store.logprobs[0] - full[len(p) - 1][r.output_ids[0]]) < 1e-4


def test_what_was_not_kept_is_computed(tiny: LoadedModel) -> None:
    """Kept entries serve a request that asks for the same or less: a top list as long or
    longer (truncated), fixed ids that begin with those asked; else the prompt is computed
    (and kept with what it asked). A plain prompt takes the keys and values alone."""
    ctx, ps = prompts(tiny, "Pick the right answer to this question, please.\n" * 5)
    chat = Chat(tiny, EngineConfig(prefix_cache_mib=64))
    steps = [  # (params, cached tokens)
        (scoring(2), 0),
        (scoring(5), 0),  # more than the kept two: computed, kept with five
        (scoring(1), len(ctx) - 1),  # the five's first one
        (scoring(0, ids=[5, 7, 11]), 0),  # fixed ids: a natural list never serves them
        (scoring(0, ids=[5, 7]), len(ctx) - 1),
        (scoring(0, ids=[7, 5]), 0),  # another order: computed
        (scoring(3), 0),  # the most recent kept ids are [7, 5]: computed
    ]
    try:
        for i, (params, cached) in enumerate(steps):
            [r] = chat.send([ps[i % 4]], params)
            assert r.cached_tokens == cached, i
            full = reference_logprobs(tiny, ps[i % 4])
            if params.logprob_token_ids:
                check_fixed(r, full, params.logprob_token_ids)
            else:
                check_prompt_store(r, full, params.num_prompt_top)
        # A plain prompt starts from the last scored one's keys and values, all of them.
        plain = SamplingParams(max_tokens=2, temperature=0, logprobs=True, ignore_eos=True)
        last = ps[(len(steps) - 1) % 4]
        [r] = chat.send([last + [100]], plain)
        assert r.cached_tokens == len(last)
    finally:
        chat.client.shutdown()


def check_fixed(r: Record, full: np.ndarray, ids: tuple[int, ...]) -> None:
    """Prompt entries with fixed ids: each position's alternatives are exactly those ids."""
    store, prompt = r.prompt_store, r.prompt_ids
    assert store is not None and len(store) == len(prompt) - 1 and store.k == len(ids)
    for i in range(1, len(prompt)):
        assert store.token_ids[i - 1] == prompt[i]
        assert abs(store.logprobs[i - 1] - full[i - 1][prompt[i]]) < 1e-4
        top_ids, top_lps = store.top(i - 1)
        assert list(top_ids) == list(ids)
        np.testing.assert_allclose(top_lps, full[i - 1][list(ids)], atol=1e-4)


def test_new_weights_never_reuse_the_old_ones_entries(tiny_dir: Path, tmp_path: Path) -> None:
    """After a weight update the same context is computed again, and scores as the new model
    does (a full forward pass of the moved weights)."""
    model = load_model(str(tiny_dir))
    moved = moved_copy(tiny_dir, tmp_path)
    ctx, ps = prompts(model)
    old = [reference_logprobs(model, p) for p in ps[:2]]  # the engine loads into `model`
    chat = Chat(model, EngineConfig(prefix_cache_mib=64))
    try:
        [a] = chat.send([ps[0]], scoring())
        [b] = chat.send([ps[1]], scoring())
        result = chat.engine.post(UpdateWeights(WeightUpdate(str(moved)))).result(timeout=120)
        assert result.error is None
        [c] = chat.send([ps[2]], scoring())
        [d] = chat.send([ps[3]], scoring())
    finally:
        chat.client.shutdown()
    assert [r.cached_tokens for r in (a, b, c, d)] == [0, len(ctx) - 1, 0, len(ctx) - 1]
    new = load_model(str(moved))
    refs = [*old, *(reference_logprobs(new, p) for p in ps[2:])]
    for r, ref in zip((a, b, c, d), refs):
        check_prompt_store(r, ref, 5)


def test_prompts_wait_only_for_entries_they_can_take(tiny: LoadedModel) -> None:
    """Sent together, a scored prompt waits a step for one being prefilled only when that one's
    entries will answer it: the first asks for one top entry, so the second (five) computes
    beside it, and the last two wait for the second's."""
    ctx, ps = prompts(tiny, "Another context, long enough to be worth waiting for.\n" * 5)
    asks = [scoring(1), scoring(5), scoring(5), scoring(2)]
    runs = run_engine(tiny, list(zip(ps, asks)), EngineConfig(prefix_cache_mib=64))
    assert [r.cached_tokens for r, _ in runs] == [0, 0, len(ctx) - 1, len(ctx) - 1]
    for (r, _), p, ask in zip(runs, ps, asks):
        check_prompt_store(r, reference_logprobs(tiny, p), ask.num_prompt_top)
