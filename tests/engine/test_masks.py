"""vLLM's generation controls in the batched sampler: allowed_token_ids, bad words, min_tokens
(token masks on the device), and the four logprobs modes, each against an independent float32
forward pass of the same tokens."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner import plan
from omlx_logprobs.runner.sampler import MaskState, _bad_word_condition
from omlx_logprobs.types import FinishReason, LogprobsMode, SamplingParams
from tests.helpers.engine import encode, run_engine

PROMPTS = ["Hello, how are you today?", "The quick brown fox", "1 2 3 4 5", "Once upon a time"]


def raw_logits(model: LoadedModel, prompt: list[int], out: list[int]) -> np.ndarray:
    """[len(out), V] float64: the logits each generated token was sampled after."""
    logits = np.array(model.model(mx.array([prompt + out]))[0].astype(mx.float32), np.float64)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)])
    return x - (m + np.log(np.sum(np.exp(x - m))))


@pytest.fixture(params=[False, True], ids=["host", "gpu-path"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both extraction paths: numpy at collect time, and the device's packed step with each
    step processed on a second thread beside the next launch."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", request.param)
    return bool(request.param)


def test_four_modes_against_a_float32_forward(tiny: LoadedModel, path: bool) -> None:
    """raw: the model's own log-softmax, before the logit bias and the temperature; processed:
    the log-softmax of the biased, tempered logits; the `_logits` modes: the values themselves."""
    prompt = encode(tiny, PROMPTS[1])
    target = encode(tiny, " the")[0]
    base = SamplingParams(
        max_tokens=12, temperature=0.7, seed=11, logit_bias=((target, 3.0),), logprobs=True,
        top_logprobs=3, ignore_eos=True,
    )  # fmt: skip
    modes = list(LogprobsMode)
    runs = run_engine(tiny, [(prompt, replace(base, logprobs_mode=m)) for m in modes])
    out = list(runs[0][0].output_ids)
    assert all(list(r.output_ids) == out for r, _ in runs)  # the mode changes no token
    rows = raw_logits(tiny, prompt, out)
    for (rec, _), mode in zip(runs, modes):
        for i, tok in enumerate(out):
            x = rows[i].copy()
            if mode.processed:
                x[target] += 3.0
                x /= 0.7
            want = x if mode.logits else log_softmax(x)
            assert abs(rec.store.logprobs[i] - want[tok]) < 1e-4, (mode, i)
            assert rec.store.ranks[i] == int(np.sum(want >= want[tok]))
            ids, lps = rec.store.top(i)
            np.testing.assert_allclose(lps, np.sort(want)[::-1][:3], atol=1e-4)
            np.testing.assert_allclose(want[ids], lps, atol=1e-4)


def test_allowed_token_ids_bound_every_sampled_token(tiny: LoadedModel, path: bool) -> None:
    prompt = encode(tiny, PROMPTS[2])
    allowed = tuple(sorted(encode(tiny, " cat dog bird fish the a")))
    base = SamplingParams(
        max_tokens=16, temperature=1.0, seed=5, allowed_token_ids=allowed, logprobs=True,
        top_logprobs=len(allowed) + 2, ignore_eos=True,
    )  # fmt: skip
    runs = run_engine(
        tiny,
        [(prompt, replace(base, logprobs_mode=LogprobsMode.PROCESSED)), (prompt, base)],
    )
    (proc, _), (raw, _) = runs
    out = list(proc.output_ids)
    assert out == list(raw.output_ids) and set(out) <= set(allowed)
    rows = raw_logits(tiny, prompt, out)
    for i, tok in enumerate(out):
        masked = np.full_like(rows[i], -np.inf)
        masked[list(allowed)] = rows[i][list(allowed)]
        assert abs(proc.store.logprobs[i] - log_softmax(masked)[tok]) < 1e-4
        assert abs(raw.store.logprobs[i] - log_softmax(rows[i])[tok]) < 1e-4
        ids, lps = proc.store.top(i)  # the top list is the allowed set, then -inf
        assert set(ids[: len(allowed)].tolist()) == set(allowed)
        assert np.all(np.isneginf(lps[len(allowed) :]))


def test_min_tokens_holds_back_eos_and_stop_ids(tiny: LoadedModel, path: bool) -> None:
    prompt = encode(tiny, PROMPTS[0])
    eos = tiny.eos_token_ids[0]
    stop_id = encode(tiny, " the")[0]
    forced = SamplingParams(
        max_tokens=20, temperature=0, logit_bias=((eos, 100.0), (stop_id, 90.0)),
        stop_token_ids=(stop_id,), min_tokens=4, logprobs=True,
    )  # fmt: skip
    free = replace(forced, min_tokens=0)
    (held, outs), (plain, _) = run_engine(tiny, [(prompt, forced), (prompt, free)])
    assert list(plain.output_ids) == [eos]
    out = list(held.output_ids)
    assert len(out) == 5 and out[-1] == eos and outs[-1].finish_reason is FinishReason.STOP
    assert not {eos, stop_id} & set(out[:4])


def test_bad_words_ban_a_word_after_its_prefix(tiny: LoadedModel, path: bool) -> None:
    """A two-token word's second token is banned right after its first, which is still on the
    device when the next step is launched (no extra host sync); a one-token word always. Seeded:
    the same noise each step, so the output is the free one's up to the first ban."""
    prompt = encode(tiny, PROMPTS[3])
    free = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    [(base, _)] = run_engine(tiny, [(prompt, free)])
    o = list(base.output_ids)
    pairs = list(zip(o, o[1:]))
    i = next(j for j in range(4, len(o)) if pairs[j - 1] not in pairs[: j - 1])
    k = next(j for j in range(2, len(o)) if o[j] not in o[:j])
    pair = replace(free, bad_words_ids=((o[i - 1], o[i]),))
    single = replace(free, bad_words_ids=((o[k],),))
    (a, _), (b, _) = run_engine(tiny, [(prompt, pair), (prompt, single)])
    got = list(a.output_ids)
    assert got[:i] == o[:i] and got[i] != o[i]
    assert all((x, y) != (o[i - 1], o[i]) for x, y in zip(got, got[1:]))
    assert list(b.output_ids)[:k] == o[:k] and o[k] not in list(b.output_ids)


@pytest.mark.parametrize(
    "word, output, in_flight, sampled, want",
    [
        ((7,), [], False, 0, -1),  # one token: always
        ((3, 7), [], False, 0, None),  # a prefix longer than the output: not yet
        ((3, 7), [1, 3], False, 2, -1),  # prefix ends the output (all on the host)
        ((3, 7), [1, 2], False, 2, None),
        ((3, 7), [1], True, 2, 3),  # the last token is on the device: decided there
        ((2, 3, 7), [1, 2], True, 3, 3),
        ((2, 3, 7), [1, 5], True, 3, None),  # the host part already fails
    ],
)
def test_bad_word_condition(
    word: tuple[int, ...], output: list[int], in_flight: bool, sampled: int, want: int | None
) -> None:
    assert _bad_word_condition(word, MaskState(sampled, output, in_flight)) == want
