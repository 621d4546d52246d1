"""The tail mass through the engine (`SamplingParams.tail_logprob`), against an independent full
forward pass: each generated and prompt position's log of the probability outside its returned
list, for top lists of 1, 20 and 256 and for `logprob_token_ids`, rows of one batch asking for
lists of their own length, on the CPU's host path and the device path, and prompt entries served
from a kept prefix extracted with a longer list; tokens accepted from a prediction; entries with
tails between processes."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner import plan
from omlx_logprobs.types import Entries, SamplingParams
from tests.engine.test_conversation_cache import Chat
from tests.engine.test_prompt_cache import prompts, scoring
from tests.helpers.engine import Record, count_verifies, encode, reference_logprobs, run_engine

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
TOL = 1e-5
# The device path run on MLX's CPU: its log-sum-exp over a 49k row drifts up to ~2e-5 from
# float64 (tests/unit/test_tail.py); the host path, which the CPU serves with, holds TOL.
DEVICE_ON_CPU_TOL = 5e-5


def reference_tails(ref: np.ndarray, listed: np.ndarray) -> np.ndarray:
    """[n]: each row's log-sum-exp (float64) of the reference log-softmax outside its ids."""
    out = []
    for row, ids in zip(ref.astype(np.float64), listed):
        out.append(np.logaddexp.reduce(np.delete(row, ids)))
    return np.array(out)


def check_tails(e: Entries, ref: np.ndarray, tol: float = TOL) -> None:
    """Entries' tails against the reference rows they were extracted from."""
    assert e.tail is not None and len(e.tail) == len(e) == len(ref)
    np.testing.assert_allclose(e.tail, reference_tails(ref, e.top_ids), atol=tol, rtol=0)


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens emitted by speculative steps, counted as they are collected."""
    return count_verifies(monkeypatch)


def generated_rows(tiny: LoadedModel, prompt: list[int], r: Record) -> np.ndarray:
    return reference_logprobs(tiny, prompt + list(r.output_ids))[len(prompt) - 1 : -1]


@pytest.mark.parametrize("gpu_path", [False, True])
def test_sampled_positions_tails_for_lists_of_1_20_and_256(
    tiny: LoadedModel, gpu_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests in one batch (K = 256), each with its own list length: every tail leaves
    out exactly its own list. `gpu_path`: extracted as on a device (MLX ops), else in numpy."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", gpu_path)
    prompt = encode(tiny, TEXT)
    reqs = [
        (prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=k,
                                tail_logprob=True, ignore_eos=True))
        for k in (1, 20, 256)
    ]  # fmt: skip
    for (r, _), (_, params) in zip(run_engine(tiny, reqs), reqs):
        assert r.store is not None and r.store.k == params.top_logprobs
        tol = DEVICE_ON_CPU_TOL if gpu_path else TOL
        check_tails(r.store.entries, generated_rows(tiny, prompt, r), tol)


def test_sampled_positions_tail_outside_logprob_token_ids(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    ids = (5, 17, 300, 2)
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=True,
                            logprob_token_ids=ids, tail_logprob=True)  # fmt: skip
    plain = SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    [(r, _), (other, _)] = run_engine(tiny, [(prompt, params), (prompt, plain)])
    assert r.store is not None and r.store.top_ids.reshape(-1, 4).tolist()[0] == list(ids)
    check_tails(r.store.entries, generated_rows(tiny, prompt, r))
    assert other.store is not None and other.store.entries.tail is None  # not asked: none


@pytest.mark.parametrize("k", [1, 20, 256])
def test_prompt_positions_tails(tiny: LoadedModel, k: int) -> None:
    prompt = encode(tiny, TEXT * 3)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k, tail_logprob=True)
    [(r, _)] = run_engine(tiny, [(prompt, params)], EngineConfig(prefill_chunk=29))
    assert r.prompt_store is not None and r.prompt_store.k == k
    check_tails(r.prompt_store.entries, reference_logprobs(tiny, prompt)[:-1])


def test_prompt_positions_tail_outside_logprob_token_ids(tiny: LoadedModel) -> None:
    prompt = encode(tiny, TEXT)
    params = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0,
                            logprob_token_ids=(9, 4, 1000), tail_logprob=True)  # fmt: skip
    [(r, _)] = run_engine(tiny, [(prompt, params)])
    assert r.prompt_store is not None
    check_tails(r.prompt_store.entries, reference_logprobs(tiny, prompt)[:-1])


def test_prompt_tails_from_a_kept_prefix(tiny: LoadedModel) -> None:
    """A context scored with 20 alternatives and its tail is kept; a later prompt on it asking
    for 5 takes the context's entries from the cache, its tails widened by the 15 left out; one
    asking for a tail where the kept entries have none is computed."""
    ctx, ps = prompts(tiny)
    chat = Chat(tiny, EngineConfig(prefix_cache_mib=64))

    def tailed(k: int, tail: bool = True) -> SamplingParams:
        return replace(scoring(k), tail_logprob=tail)

    steps = [(tailed(20), 0), (tailed(5), len(ctx) - 1), (tailed(20, False), len(ctx) - 1)]
    try:
        for i, (params, cached) in enumerate(steps):
            [r] = chat.send([ps[i]], params)
            assert r.error is None and r.cached_tokens == cached, i
            assert r.prompt_store is not None and r.prompt_store.k == params.num_prompt_top
            if params.tail_logprob:
                check_tails(r.prompt_store.entries, reference_logprobs(tiny, ps[i])[:-1])
            else:
                assert r.prompt_store.entries.tail is None
        chat_off = Chat(tiny, EngineConfig(prefix_cache_mib=64))
        try:  # kept without a tail: a prompt asking for one computes it
            [a] = chat_off.send([ps[0]], scoring(20))
            [b] = chat_off.send([ps[1]], tailed(5))
            assert a.cached_tokens == 0 and b.cached_tokens == 0
            assert b.prompt_store is not None
            check_tails(b.prompt_store.entries, reference_logprobs(tiny, ps[1])[:-1])
        finally:
            chat_off.client.shutdown()
    finally:
        chat.client.shutdown()


def test_tails_of_tokens_accepted_as_drafts(tiny: LoadedModel, verified: list[int]) -> None:
    """Predicted Outputs: tokens emitted by a verify step carry the tails of their own rows."""
    prompt = encode(tiny, TEXT)
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=True, top_logprobs=20,
                        tail_logprob=True, ignore_eos=True)  # fmt: skip
    [(plain, _)] = run_engine(tiny, [(prompt, sp)], EngineConfig(speculate="off"))
    ask = replace(sp, prediction=tuple(plain.output_ids))
    [(fast, _)] = run_engine(tiny, [(prompt, ask)], EngineConfig(speculate="prediction"))
    assert sum(verified) > 10 and list(fast.output_ids) == list(plain.output_ids)
    assert fast.store is not None
    check_tails(fast.store.entries, generated_rows(tiny, prompt, fast))


def test_entries_with_tails_cross_processes_as_one_buffer() -> None:
    rng = np.random.default_rng(0)
    e = Entries(
        np.arange(3, dtype=np.int32), rng.standard_normal(3).astype(np.float32),
        np.ones(3, np.int32), np.zeros((3, 2), np.int32),
        rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(3).astype(np.float32),
    )  # fmt: skip
    back = pickle.loads(pickle.dumps(e))
    for a, b in zip(e.arrays(), back.arrays()):
        np.testing.assert_array_equal(a, b)
    assert len(back.arrays()) == 6 and pickle.loads(pickle.dumps(back.rows(0, 0))).k == 2
