"""Scores of (query, document) pairs from the completions path: each pair's prompt (the yes/no
template's text, tokenized whole as the completions route tokenizes a text prompt) becomes one
prompt of a completions request with `max_tokens` 1, `logprob_token_ids` [yes, no] and the raw
logprobs, prepared and submitted as that route's (api/core/prepare.py), all prompts at once so
that they are batched and share their start in the prefix cache. One generated position is the
cheapest way to the answer's logits: prompt scoring would extract every prompt position, and
the prefill computes the last position's logits anyway. p(yes) = exp(lp_yes) / (exp(lp_yes) +
exp(lp_no)): the vocabulary's normalizer cancels, so it is the softmax of the two logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastapi import Request

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.prepare import Ask, prepare
from omlx_logprobs.api.core.prompts import MAX_PROMPTS, encode
from omlx_logprobs.api.core.protocol import CompletionRequest
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.scoring.protocol import ScoringFields
from omlx_logprobs.api.scoring.template import YesNoTemplate, answer_ids

MAX_PAIRS = MAX_PROMPTS  # as many as one completions request's prompts


@dataclass(frozen=True)
class Scored:
    scores: list[float]  # per pair, in the order given
    prompt_tokens: int
    cached_tokens: int  # of those, the ones whose keys and values came from the prefix cache
    model: str  # the name the response carries: the adapter's, or the model's


def p_yes(lp_yes: float, lp_no: float) -> float:
    """The softmax of the two answers' logits, from their logprobs (in float64; the exp of a
    difference at most 0, so it never overflows)."""
    d = lp_yes - lp_no
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def check_pairs(pairs: list[tuple[str, str]], names: tuple[str, str]) -> None:
    """What needs no model: some documents, not too many, no blank query."""
    query_param, param = names
    if not pairs:
        raise APIError(f"{param} must not be empty", param=param)
    if any(not q.strip() for q, _ in pairs):
        raise APIError(f"{query_param} must not be empty", param=query_param)
    if len(pairs) > MAX_PAIRS:
        raise APIError(f"At most {MAX_PAIRS} {param} may be scored at once.", param=param)


async def score_pairs(
    pairs: list[tuple[str, str]],
    req: ScoringFields,
    served: Served,
    template: YesNoTemplate,
    raw: Request,
    names: tuple[str, str],
) -> Scored:
    """`names`: the wire's names of the queries and of the documents, for the 400s."""
    check_pairs(pairs, names)
    param = names[1]
    name = req.model or served.model.name
    served.check_model(name)
    yes, no = answer_ids(served.model)
    prompts = []
    for query, document in pairs:
        text = template.render(query, document, req.instruction)
        served.checks.check_text(text, param)
        prompts.append(encode(served.model, text, param, special=True))
    completion = CompletionRequest.model_validate(
        {
            "model": name,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 2,
            "logprob_token_ids": [yes, no],
            "logprobs_mode": "raw_logprobs",
            "priority": req.priority,
            "cache_salt": req.cache_salt,
        }
    )
    ask = Ask(completion, 1, True, 2, prefix="score-", prompt_param=param)
    p = prepare(ask, served)
    outs = await finished(p.submit(served), raw)
    scores = []
    for out in outs:
        assert out.logprobs is not None  # one position, the two answers' entries
        lp_yes, lp_no = (float(x) for x in out.logprobs.top_logprobs[0])
        scores.append(lp_yes - lp_no if req.use_activation is False else p_yes(lp_yes, lp_no))
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    return Scored(scores, prompt_tokens, sum(o.cached_tokens for o in outs), p.model)
