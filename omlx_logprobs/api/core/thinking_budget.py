"""A chat request's thinking budget (batch/budget.py enforces it): vLLM's `thinking_token_budget`,
or the server's `--reasoning-budgets` entry for the request's `reasoning_effort`, and the ids of
the model's own closing tag that are forced at the budget."""

from __future__ import annotations

from dataclasses import replace

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.prompts import encode
from omlx_logprobs.api.core.protocol import ChatCompletionRequest
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.types import SamplingParams

__all__ = ["with_thinking_budget"]


def with_thinking_budget(
    req: ChatCompletionRequest, served: Served, params: SamplingParams
) -> SamplingParams:
    """`params` with the request's budget, if it has one. An explicit budget on a model whose
    reasoning is not parsed is a 400 (as vLLM answers one without a reasoning config); an
    effort's budget there is no budget (the effort still reaches the template)."""
    budget = req.thinking_token_budget
    explicit = budget is not None and budget >= 0  # vLLM: -1 is no budget
    if not explicit and req.reasoning_effort is not None:
        budget = dict(served.cfg.reasoning_budgets).get(req.reasoning_effort)
    elif not explicit:
        budget = None
    if budget is None:
        return params
    if not served.reasoning:
        if not explicit:
            return params
        raise APIError(
            "thinking_token_budget needs a reasoning model: this server does not parse the"
            " model's reasoning (no think markers, or --reasoning-parser none)",
            param="thinking_token_budget",
        )
    close = tuple(encode(served.model, served.reasoning_tags[1], "thinking_token_budget"))
    return replace(params, thinking_token_budget=budget, thinking_end_ids=close)
