"""Thinking budgets through the real engine on the scripted reasoning model: a script whose
reasoning never closes gets exactly the budget's reasoning tokens, then the model's own
`</think>` forced, then its answer; the forced token's entry is marked and keeps the model's
own logprob (raw) or the sampled distribution's (processed: 0)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.engine.overlap import Overlap
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.parsing.thinking import ThinkStart
from omlx_logprobs.types import FinishReason, LogprobsMode, SamplingParams
from tests.engine.test_scripted import prompt
from tests.helpers.engine import run_engine, run_on
from tests.helpers.scripted import CHOSEN_LOGIT, CHOSEN_SLOPE, REST_LOGIT, case_ids, expected


def _budget(model: LoadedModel, n: int, **kw: object) -> SamplingParams:
    close = model.tokenizer.convert_tokens_to_ids("</think>")
    return SamplingParams(
        max_tokens=64,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        thinking_token_budget=n,
        thinking_end_ids=(close,),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("budget", [0, 1, 4])
@pytest.mark.parametrize("chunk", [512, 3])
def test_unclosed_reasoning_is_closed_at_the_budget(
    scripted: LoadedModel, budget: int, chunk: int
) -> None:
    """The "open" script never writes </think>: with a budget of N, <think>, N reasoning
    tokens, the forced </think>, and the script's later tokens as the answer. Beside it, a row
    without a budget writes its script unchanged (the batch shares the steps)."""
    ids, _ = case_ids(scripted, "open")  # <think>, reasoning..., <|im_end|>
    close = scripted.tokenizer.convert_tokens_to_ids("</think>")
    p = prompt(scripted, "open", 0)
    free = SamplingParams(max_tokens=64, temperature=0)
    got = run_engine(
        scripted,
        [(p, _budget(scripted, budget)), (p, free)],
        EngineConfig(prefill_chunk=chunk),
        [ThinkStart.DETECT, ThinkStart.DETECT],
    )
    (seq, outs), (plain, _) = got
    out = seq.output_ids.tolist()
    want = ids[: 1 + budget] + [close] + ids[2 + budget :]
    assert out == want
    assert plain.output_ids.tolist() == ids
    assert seq.finish_reason is FinishReason.STOP
    reasoning = "".join(o.reasoning_text for o in outs)
    content = "".join(o.text for o in outs)
    text = scripted.tokenizer.decode(ids[1:-1])
    assert reasoning == scripted.tokenizer.decode(ids[1 : 1 + budget])
    assert content == text[len(reasoning) :][len(scripted.tokenizer.decode([ids[1 + budget]])) :]
    # the forced entry: marked, with the model's own logprob of </think> (its rest logit)
    assert seq.store is not None
    e = seq.store.entries
    assert e.forced is not None and np.flatnonzero(e.forced).tolist() == [1 + budget]
    step = 1 + budget
    chosen = expected(step, ids[step], len(scripted.vocab))
    lse = CHOSEN_LOGIT + CHOSEN_SLOPE * step - chosen.logprob
    assert e.token_ids[step] == close
    assert abs(float(e.logprobs[step]) - (REST_LOGIT - lse)) < 2e-5
    assert e.ranks[step] > 20  # far from sampled: it was forced


def test_processed_logprob_of_a_forced_token_is_zero(scripted: LoadedModel) -> None:
    """Processed logprobs are what was sampled from: the forced token alone."""
    p = prompt(scripted, "open", 0)
    params = _budget(scripted, 2, logprobs_mode=LogprobsMode.PROCESSED)
    [(seq, _)] = run_engine(scripted, [(p, params)], thinks=[ThinkStart.DETECT])
    assert seq.store is not None
    e = seq.store.entries
    assert np.flatnonzero(e.forced).tolist() == [3]
    assert float(e.logprobs[3]) == 0.0 and int(e.ranks[3]) == 1
    assert math.isinf(float(e.top_logprobs[3][1])) or float(e.top_logprobs[3][1]) < -1e30


def test_prompt_opened_reasoning_counts_from_the_first_token(scripted: LoadedModel) -> None:
    """The template opened <think>: output token 0 is already reasoning, so a budget of 0
    forces </think> first; the script's own tokens follow as the answer."""
    p = prompt(scripted, "opened", 0, enable_thinking=True)
    close = scripted.tokenizer.convert_tokens_to_ids("</think>")
    ids, _ = case_ids(scripted, "opened")
    [(seq, outs)] = run_engine(scripted, [(p, _budget(scripted, 0))], thinks=[ThinkStart.INSIDE])
    rest = ids[2:]  # the template wrote "<think>\n"
    assert seq.output_ids.tolist() == [close, *rest[1:]]
    assert "".join(o.reasoning_text for o in outs) == ""
    assert "".join(o.text for o in outs) == "</think> out"  # the script's close is text now
    assert seq.store is not None
    assert np.flatnonzero(seq.store.entries.forced).tolist() == [0]


def test_reasoning_closed_within_the_budget_is_left_alone(scripted: LoadedModel) -> None:
    """The "special" script closes its reasoning after a few tokens: a larger budget forces
    nothing and marks nothing."""
    ids, _ = case_ids(scripted, "special")
    p = prompt(scripted, "special", 0)
    [(seq, _)] = run_engine(scripted, [(p, _budget(scripted, 40))], thinks=[ThinkStart.DETECT])
    assert seq.output_ids.tolist() == ids
    assert seq.store is not None and seq.store.entries.forced is None


def test_content_first_output_is_never_forced(scripted: LoadedModel) -> None:
    """The "plain" script opens with content: the budget has nothing to count."""
    ids, _ = case_ids(scripted, "plain")
    p = prompt(scripted, "plain", 0)
    [(seq, _)] = run_engine(scripted, [(p, _budget(scripted, 0))], thinks=[ThinkStart.DETECT])
    assert seq.output_ids.tolist() == ids


def test_budget_needs_the_closing_ids() -> None:
    with pytest.raises(ValueError):
        SamplingParams(thinking_token_budget=3)
    with pytest.raises(ValueError):
        SamplingParams(thinking_token_budget=-1, thinking_end_ids=(5,))


def test_drafts_never_skip_the_forced_token(scripted: LoadedModel) -> None:
    """A prediction of the unforced script: the budgeted row gets no drafts while its reasoning
    is open (a draft past the budget would skip the forced </think>), and is forced as alone;
    the free row beside it speculates with the same prediction and accepts it."""
    ids, _ = case_ids(scripted, "open")
    close = scripted.tokenizer.convert_tokens_to_ids("</think>")
    p = prompt(scripted, "open", 0)
    budget = replace(_budget(scripted, 3), prediction=tuple(ids))
    free = SamplingParams(max_tokens=64, temperature=0, prediction=tuple(ids))
    cfg = EngineConfig(speculate="prediction", speculate_max_batch=8)
    got = run_engine(scripted, [(p, budget), (p, free)], cfg, [ThinkStart.DETECT] * 2)
    (seq, outs), (plain, plain_outs) = got
    assert seq.output_ids.tolist() == [*ids[:4], close, *ids[5:]]
    assert plain.output_ids.tolist() == ids
    assert plain_outs[-1].accepted_prediction_tokens > 0
    # drafts resume once the reasoning is closed: only the tokens after </think> can be taken
    assert outs[-1].accepted_prediction_tokens <= len(ids) - 5


def test_with_the_step_processed_beside_the_launch(scripted: LoadedModel) -> None:
    """As on a GPU: the step in flight processed on a second thread while the next launches
    (engine/overlap.py). Budgeted rows far from their budget overlap; near it the engine
    processes first, and the forced token lands where it must."""
    ids, _ = case_ids(scripted, "open")
    close = scripted.tokenizer.convert_tokens_to_ids("</think>")
    p = prompt(scripted, "open", 0)
    engine = Engine(
        scripted.model, scripted.vocab, scripted.eos_token_ids, EngineConfig(),
        tokenizer=scripted.tokenizer,
    )  # fmt: skip
    engine.overlap = Overlap(engine._process, aside=True)
    budgets = [0, 2, 5, 40]
    reqs = [(p, _budget(scripted, n)) for n in budgets]
    got = run_on(engine, reqs, [ThinkStart.DETECT] * len(reqs))
    for n, (seq, _) in zip(budgets, got):
        want = ids if n >= len(ids) - 2 else [*ids[: 1 + n], close, *ids[2 + n :]]
        assert seq.output_ids.tolist() == want, n
