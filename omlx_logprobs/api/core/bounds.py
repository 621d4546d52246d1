"""The facts about the served model that a request's limits depend on (its vocabulary, its
context, its longest token, its chat template's own parameters, the memory its keys and values
may take), read once when the model is loaded; api/core/validation.py checks against them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from omlx_logprobs.models.footprint import kv_memory
from omlx_logprobs.models.moe import RoutingShape, routing_shape

# What the template renderer itself passes to Jinja besides apply_chat_template's parameters.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


@dataclass(frozen=True)
class ModelBounds:
    """The facts about the served model that limits depend on."""

    vocab_size: int
    max_model_len: int
    max_top_logprobs: int
    max_token_bytes: int  # the longest token's text, special tokens included
    template_params: frozenset[str]  # apply_chat_template's own parameters
    # One token's keys and values, and the memory the weights leave for them (0: unchecked).
    kv_bytes_per_token: int = 0
    kv_budget_bytes: int = 0
    # A mixture of experts whose routing is recorded and replayed (api/core/routed_experts.py).
    routing: RoutingShape | None = None


def model_bounds(model: Any, max_top_logprobs: int) -> ModelBounds:
    """From a LoadedModel (typed as Any: models.loader imports mlx, this module must not)."""
    vocab = model.vocab
    longest = max(
        len(b) if b is not None else len(t.encode("utf-8", "replace"))
        for b, t in zip(vocab.token_bytes, vocab.token_text)
    )
    try:
        params = inspect.signature(model.tokenizer.apply_chat_template).parameters
        reserved = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    except (TypeError, ValueError, AttributeError):
        reserved = set()
    reserved |= TEMPLATE_VARIABLES
    # --max-logprobs -1: the whole vocabulary; no list is longer than the vocabulary anyway
    cap = len(vocab) if max_top_logprobs < 0 else min(max_top_logprobs, len(vocab))
    per_token, budget = kv_memory(model)
    return ModelBounds(
        len(vocab),
        model.max_model_len,
        cap,
        max(longest, 1),
        frozenset(reserved),
        per_token,
        budget,
        routing_shape(path) if (path := getattr(model, "path", None)) else None,
    )
