"""From a validated request to the engine's inputs: the prompt's token ids (text through the
tokenizer, chat messages through the chat template) and its `SamplingParams`, each value the
engine cannot take a 400 (the checks live in api/validation.py)."""

from __future__ import annotations

from omlx_logprobs.api import tools
from omlx_logprobs.api.constraints import request_constraint
from omlx_logprobs.api.errors import APIError
from omlx_logprobs.api.protocol import ChatCompletionRequest, SamplingKnobs
from omlx_logprobs.api.served import Served
from omlx_logprobs.api.validation import RequestLimits
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import LogprobsMode, SamplingParams


def sampling_params(
    req: SamplingKnobs,
    served: Served,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
    prompt_param: str | None = None,
) -> SamplingParams:
    """Request fields as SamplingParams; a 400 for every value the engine cannot take (the
    checks live in api/validation.py). `prompt_logprobs` is what the engine computes (the
    caller may ask more than the field); `prompt_param` names the prompt in a 400."""
    checks = served.checks
    completion = getattr(req, "max_completion_tokens", None) is not None
    tokens_param = "max_completion_tokens" if completion else "max_tokens"
    prompt_param = prompt_param or ("messages" if hasattr(req, "messages") else "prompt")
    room = checks.check_prompt(prompt_len, max_tokens, prompt_param, tokens_param)
    cap = checks.bounds.max_top_logprobs
    if prompt_logprobs is not None and prompt_logprobs > cap:
        raise APIError(f"prompt_logprobs must be at most {cap}", param="prompt_logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    any_logprobs = logprobs or prompt_logprobs is not None
    limit = max_tokens if max_tokens is not None else room
    if req.min_tokens > limit:
        raise APIError(
            f"min_tokens ({req.min_tokens}) must be at most {tokens_param} ({limit})",
            param="min_tokens",
        )
    return SamplingParams(
        max_tokens=limit,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=min(max(req.top_k, 0), checks.bounds.vocab_size),
        min_p=req.min_p,
        seed=req.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logit_bias=checks.logit_bias(req.logit_bias or {}),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        logprob_token_ids=checks.logprob_token_ids(req.logprob_token_ids, any_logprobs),
        logprobs_mode=LogprobsMode(req.logprobs_mode or served.cfg.logprobs_mode),
        min_tokens=req.min_tokens,
        allowed_token_ids=tuple(sorted(set(req.allowed_token_ids or ()))),
        bad_words_ids=checks.bad_words_ids(
            req.bad_words, lambda w: encode(served.model, w, "bad_words")
        ),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        constraint=request_constraint(req),
    )


def chat_prompt(
    req: ChatCompletionRequest, model: LoadedModel, checks: RequestLimits | None = None
) -> list[int]:
    messages = tools.template_messages(req.messages)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # a template variable, as vLLM passes it
        kwargs["reasoning_effort"] = req.reasoning_effort
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = model.tokenizer.apply_chat_template(
            messages,
            tools=tools.template_tools(req.tools),
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # a template error is the request's fault
        raise APIError(
            f"The chat template could not render these messages: {e}", param="messages"
        ) from None
    if checks is not None:
        checks.check_text(text, "messages")
    ids = encode(model, text, "messages", special=req.add_special_tokens)
    return checks.truncated(ids, req.truncate_prompt_tokens) if checks is not None else ids


def encode(model: LoadedModel, text: str, param: str, special: bool = False) -> list[int]:
    """Token ids of text; a tokenizer that fails on it fails this request alone, as a 400."""
    try:
        return list(model.tokenizer.encode(text, add_special_tokens=special))
    except Exception as e:
        raise APIError(f"The text could not be tokenized: {e}", param=param) from None
