"""Scoring and RL at the engine level, against an independent full forward pass: prompt logprobs,
processed logprobs, fixed token ids, n choices from one prefill, max_tokens 0, and the memory
bound of prompt logprobs over a long prompt."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.logprobs.extractor import HostExtractor
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner import plan
from omlx_logprobs.runner.prompt_scoring import block_sizes
from omlx_logprobs.types import (
    EngineRequest,
    FinishReason,
    LogprobsMode,
    RequestOutput,
    SamplingParams,
)
from tests.helpers.engine import (
    TINY_CONFIG,
    Record,
    check_against_reference,
    check_prompt_store,
    client_of,
    collect_outputs,
    encode,
    reference_logprobs,
    run_engine,
)

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


def test_prompt_logprobs_equal_full_forward_at_every_position(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT * 6)  # ~130 tokens: several chunks and two extraction blocks
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=5, ignore_eos=True)
    [(seq, _)] = run_engine(tiny, [(prompt, params)], EngineConfig(prefill_chunk=47))
    check_prompt_store(seq, reference_logprobs(tiny, prompt), 5)


def test_prompt_logprobs_zero_keeps_each_tokens_own_entry(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    [(seq, _)] = run_engine(tiny, [(prompt, params)], EngineConfig(prefill_chunk=5))
    assert seq.prompt_store is not None and seq.prompt_store.k == 0
    check_prompt_store(seq, reference_logprobs(tiny, prompt), 0)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    params = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=2, logprobs=True)
    other = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    runs = run_engine(tiny, [(prompt, params), (prompt, other)], EngineConfig(prefill_chunk=9))
    (seq, outs), (busy, _) = runs
    assert seq.num_output == 0 and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].completion_tokens == 0 and "".join(o.text for o in outs) == ""
    check_prompt_store(seq, reference_logprobs(tiny, prompt), 2)
    assert busy.num_output == 4  # the batch beside it was unaffected


def test_whole_prompts_scored_together_each_equal_their_own_forward(tiny: LoadedModel) -> None:
    """Whole prompts of different lengths and settings in one step: scored ones share
    left-padded forwards (one per top count), plain ones another; every prompt's entries and
    greedy continuation equal its own full forward pass."""
    texts = [TEXT, TEXT[:30], TEXT * 2, TEXT[10:50], "Hi", TEXT[:61]]
    prompts = [encode(tiny, t) for t in texts]
    settings = [
        SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=1, logprobs=True),
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=1, logprobs=True),
        SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=5, logprobs=True),
    ]
    runs = run_engine(tiny, list(zip(prompts, settings)), EngineConfig(prefill_chunk=512))
    for (seq, outs), prompt, p in zip(runs, prompts, settings):
        out = list(seq.output_ids)
        assert len(out) == p.max_tokens and outs[-1].finished
        ref = reference_logprobs(tiny, prompt + out)
        for j, tok in enumerate(out):  # greedy: each token is the argmax after its prefix
            assert tok == int(np.argmax(ref[len(prompt) - 1 + j]))
        if p.prompt_logprobs is not None:
            check_prompt_store(seq, ref, p.prompt_logprobs)
        else:
            assert seq.prompt_store is None


def processed_reference(
    row: np.ndarray, temperature: float, top_p: float, top_k: int
) -> np.ndarray:
    """Independent truncation: scale, keep the top k and the smallest prefix of mass >= top_p,
    renormalise what is left; -inf elsewhere."""
    x = row.astype(np.float64) / temperature
    lp = x - np.logaddexp.reduce(x)
    order = np.argsort(-lp, kind="stable")
    p = np.exp(lp[order])
    keep = (np.cumsum(p) - p) < top_p
    if top_k:
        keep[top_k:] = False
    out = np.full_like(lp, -np.inf)
    kept = order[keep]
    out[kept] = lp[kept] - np.logaddexp.reduce(lp[kept])
    return out


@pytest.mark.parametrize("top_p,top_k", [(0.9, 0), (1.0, 3)])
def test_processed_logprobs_are_the_sampled_distribution(
    tiny: LoadedModel, top_p: float, top_k: int
) -> None:
    prompt = encode(tiny, TEXT)
    base = SamplingParams(
        max_tokens=24, temperature=0.7, top_p=top_p, top_k=top_k, seed=17, logprobs=True,
        top_logprobs=5, ignore_eos=True,
    )  # fmt: skip
    processed = replace(base, logprobs_mode=LogprobsMode.PROCESSED)
    runs = run_engine(tiny, [(prompt, processed), (prompt, base)])
    (proc, _), (raw, _) = runs
    assert list(proc.output_ids) == list(raw.output_ids)  # the mode changes no token
    out = list(proc.output_ids)
    logits = np.array(tiny.model(mx.array([prompt + out]))[0].astype(mx.float32))
    rows = logits[len(prompt) - 1 : -1]
    for i, tok in enumerate(out):
        want = processed_reference(rows[i], 0.7, top_p, top_k)
        assert abs(proc.store.logprobs[i] - want[tok]) < 1e-4
        assert proc.store.ranks[i] == int(np.sum(want >= want[tok]))
        ids, lps = proc.store.top(i)
        np.testing.assert_allclose(np.array(lps), np.sort(want)[::-1][:5], atol=1e-4)
        raw_row = rows[i] - np.logaddexp.reduce(rows[i].astype(np.float64))
        assert abs(raw.store.logprobs[i] - raw_row[tok]) < 1e-4
    diff = np.abs(np.array(proc.store.logprobs) - np.array(raw.store.logprobs))
    assert diff.mean() > 0.1  # the two modes really report different distributions
    if top_k:  # the masked 4th and 5th entries are -inf (written -9999.0 in JSON)
        assert np.all(np.isneginf(np.array(proc.store.top_logprobs).reshape(-1, 5)[:, 3:]))


def test_processed_at_temperature_zero_is_raw(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    kw: dict[str, Any] = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    runs = run_engine(
        tiny,
        [
            (prompt, SamplingParams(**kw, logprobs_mode=LogprobsMode.PROCESSED, top_p=0.5)),
            (prompt, SamplingParams(**kw)),
        ],
    )
    (a, _), (b, _) = runs
    np.testing.assert_allclose(a.store.logprobs, b.store.logprobs, atol=1e-5)
    np.testing.assert_allclose(a.store.top_logprobs, b.store.top_logprobs, atol=1e-5)


def test_logprob_token_ids_replace_the_top_list(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    wanted = (encode(tiny, " yes")[0], encode(tiny, " no")[0], 2, 49151)
    fixed = SamplingParams(
        max_tokens=5, temperature=1.0, seed=3, logprobs=True, prompt_logprobs=0,
        logprob_token_ids=wanted, ignore_eos=True,
    )  # fmt: skip
    natural = SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=6)
    runs = run_engine(tiny, [(prompt, fixed), (prompt, natural)], EngineConfig(prefill_chunk=8))
    (seq, _), (nat, _) = runs
    out = list(seq.output_ids)
    ref = reference_logprobs(tiny, prompt + out)
    assert seq.store is not None and seq.store.k == 4
    for i, tok in enumerate(out):
        row = ref[len(prompt) - 1 + i]
        ids, lps = seq.store.top(i)
        assert tuple(ids) == wanted
        np.testing.assert_allclose(np.array(lps), row[list(wanted)], atol=1e-4)
        assert abs(seq.store.logprobs[i] - row[tok]) < 1e-4
    assert seq.prompt_store is not None and seq.prompt_store.k == 4
    for i in range(1, len(prompt)):
        ids, lps = seq.prompt_store.top(i - 1)
        assert tuple(ids) == wanted
        np.testing.assert_allclose(np.array(lps), ref[i - 1][list(wanted)], atol=1e-4)
    nat_ref = reference_logprobs(tiny, prompt + list(nat.output_ids))[len(prompt) - 1 :]
    for i in range(nat.num_output):  # the natural row in the same batch kept its own top list
        np.testing.assert_allclose(nat.store.top(i)[1], np.sort(nat_ref[i])[::-1][:6], atol=1e-4)


class CountingModel:
    """The same model, counting the prompt tokens it is given (decode steps give one per row)."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.prefill_tokens = 0

    def __call__(self, ids: mx.array, cache: Any = None) -> mx.array:
        if type(cache[0]).__name__ == "KVCache":  # a prompt's own cache, not the batch's
            self.prefill_tokens += ids.shape[1]
        return self.inner(ids, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_group(
    model: Any, tiny: LoadedModel, prompt: list[int], params: SamplingParams, n: int
) -> list[tuple[Record, list[RequestOutput]]]:
    """One request with n choices (one prefill); each choice's record and outputs."""
    engine = Engine(model, tiny.vocab, tiny.eos_token_ids, EngineConfig(prefill_chunk=16))
    client = client_of(engine)
    req = EngineRequest("g", list(prompt), params, n, stream=True)
    try:
        outs = asyncio.run(collect_outputs(client, req))
    finally:
        client.shutdown()
    return [(Record(req, o), o) for o in outs]


def test_n_choices_share_one_prefill_and_differ_by_seed(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    params = SamplingParams(
        max_tokens=10, temperature=1.0, seed=99, logprobs=True, top_logprobs=2,
        prompt_logprobs=1, ignore_eos=True,
    )  # fmt: skip
    counting = CountingModel(tiny.model)
    first = run_group(counting, tiny, prompt, params, 4)
    assert counting.prefill_tokens == len(prompt)  # the prompt went through the model once
    choices = [list(s.output_ids) for s, _ in first]
    assert len({tuple(c) for c in choices}) == 4  # each index has its own key
    again = run_group(tiny.model, tiny, prompt, params, 4)
    assert [list(s.output_ids) for s, _ in again] == choices  # (seed, index, step) repeats
    for seq, outs in first:
        # one set of prompt entries, in each choice's first output
        assert seq.prompt_store is not None and first[0][0].prompt_store is not None
        assert np.array_equal(seq.prompt_store.logprobs, first[0][0].prompt_store.logprobs)
        assert outs[-1].finish_reason is FinishReason.LENGTH
        out = list(seq.output_ids)
        ref = reference_logprobs(tiny, prompt + out)[len(prompt) - 1 : -1]
        for i, tok in enumerate(out):
            assert abs(seq.store.logprobs[i] - ref[i][tok]) < 1e-4
    check_prompt_store(first[0][0], reference_logprobs(tiny, prompt), 1)


def test_n_choices_with_max_tokens_zero_all_finish(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    runs = run_group(tiny.model, tiny, prompt, params, 3)
    assert [o[-1].finish_reason for _, o in runs] == [FinishReason.LENGTH] * 3
    assert all(s.num_output == 0 for s, _ in runs)


def small_vocab_model(vocab: int) -> Any:
    """The tiny llama with a smaller vocabulary: the bound is per vocabulary entry, and the CPU
    backend's exp makes a 49,152-wide extraction over 8,000 positions slow for `make test`."""
    from mlx_lm.models import llama

    mx.random.seed(7)
    model = llama.Model(llama.ModelArgs.from_dict({**TINY_CONFIG, "vocab_size": vocab}))
    model.model.embed_tokens.weight = mx.random.normal((vocab, 64)) * 0.15
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("vocab", [8192, pytest.param(49152, marks=pytest.mark.slow)])
def test_long_prompt_logprobs_stay_within_the_memory_bound(tiny: LoadedModel, vocab: int) -> None:
    """8,000 prompt tokens with prompt_logprobs 5: the peak stays within the bound stated in
    docs/specs/logprobs.md, (prefill_chunk + 1024) * V * 4 bytes above the same prefill without
    prompt logprobs (on CUDA plus one layer's attention), far below one [8000, V] float32 array."""
    model = replace(tiny, model=small_vocab_model(vocab)) if vocab != len(tiny.vocab) else tiny
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, vocab, 8000).tolist()
    cfg = EngineConfig(prefill_chunk=256)
    peaks = []
    for k in (None, 5):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
        [(seq, _)] = run_engine(model, [(prompt, params)], cfg)
        peaks.append(mx.get_peak_memory() - base)
    bound = (cfg.prefill_chunk + 1024) * vocab * 4  # a sixth of one [8000, V] float32 array
    if mx.cuda.is_available():
        # The spec's CUDA term: the last layer's unfused attention, which a scored chunk computes
        # and a cache-only chunk skips (float32 scores and their softmax over the whole context).
        bound += TINY_CONFIG["num_attention_heads"] * len(prompt) * cfg.prefill_chunk * 4 * 2
    assert peaks[1] - peaks[0] < bound, (peaks, bound)
    assert seq.prompt_store is not None and len(seq.prompt_store) == 7999
    head = reference_logprobs(model, prompt[:300])  # positions < 300 depend on the prefix only
    lps = np.array(seq.prompt_store.logprobs[:299])
    np.testing.assert_allclose(lps, head[np.arange(299), prompt[1:300]], atol=1e-4)
    ids, lps5 = seq.prompt_store.top(7998)  # the last position's top 5 are sorted and real
    assert len(set(ids)) == 5 and list(lps5) == sorted(lps5, reverse=True)


def test_block_sizes_cover_padded_rows_with_few_shapes() -> None:
    assert block_sizes(1) == [128]
    assert block_sizes(300) == [128, 128, 128]
    assert block_sizes(300, 512) == [256, 128]
    assert block_sizes(1500, 512) == [512, 512, 512]
    assert block_sizes(1700, 512) == [512, 512, 512, 256]
    assert block_sizes(1900, 512) == [512, 512, 512, 256, 128]
    for n in range(1, 3000, 7):
        sizes = block_sizes(n, 512)
        assert sum(sizes) == n + (-n % 128) and set(sizes) <= {128, 256, 512}


@pytest.mark.parametrize("block", [128, 512])
def test_large_extraction_blocks_give_the_same_entries(
    tiny: LoadedModel, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's larger blocks (up to 512 rows, several lengths in one prompt) and aligned group
    widths, run here on the CPU: whole prompts in one group and chunked prompts, against their
    own forward passes."""
    monkeypatch.setattr(HostExtractor, "max_block", block)
    monkeypatch.setattr(plan, "CPU_PREFILL_ALIGN", 32 if block > 128 else 1)
    prompts = [encode(tiny, TEXT * 30), encode(tiny, TEXT * 9), encode(tiny, TEXT * 14)]
    params = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=2, logprobs=True)
    for chunk in (4096, 300):  # one left-padded group; then chunks of one prompt each
        runs = run_engine(tiny, [(p, params) for p in prompts], EngineConfig(prefill_chunk=chunk))
        for (seq, _), prompt in zip(runs, prompts):
            check_prompt_store(seq, reference_logprobs(tiny, prompt), 2)


def test_gpu_path_processes_steps_beside_the_next_launch(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU's path a step is processed on a second thread while the next is launched:
    steps of scored prompts alone (no sampled rows), chunked prompts, prompts with max_tokens 0
    among generating ones and staggered ends give what the serial host path gives, and the
    prompt entries still equal a full forward pass."""
    long = encode(tiny, TEXT * 3)
    base = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    requests = [
        (long, replace(base, max_tokens=0, prompt_logprobs=3)),
        (encode(tiny, TEXT), replace(base, max_tokens=6, top_logprobs=5)),
        (long[:40], replace(base, max_tokens=2, prompt_logprobs=1)),
        (encode(tiny, "a short one"), replace(base, max_tokens=9, top_logprobs=2)),
        (long[:25], replace(base, max_tokens=0, prompt_logprobs=0)),
    ]
    cfg = EngineConfig(prefill_chunk=37)
    host = run_engine(tiny, requests, cfg)
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, cfg)
    assert engine.runner.plan.overlaps  # the path under test processes on its second thread
    engine.overlap.shutdown()
    device = run_engine(tiny, requests, cfg)
    for (a, _), (b, outs_b), (prompt, p) in zip(host, device, requests):
        assert outs_b[-1].finish_reason is FinishReason.LENGTH
        assert list(a.output_ids) == list(b.output_ids) and len(b.output_ids) == p.max_tokens
        if b.store is not None and p.max_tokens:
            np.testing.assert_allclose(b.store.logprobs, a.store.logprobs, atol=1e-5)
            assert list(b.store.top_ids) == list(a.store.top_ids)
            check_against_reference(tiny, prompt, b, p.top_logprobs)
        if p.prompt_logprobs is not None:
            check_prompt_store(b, reference_logprobs(tiny, prompt), p.prompt_logprobs)
