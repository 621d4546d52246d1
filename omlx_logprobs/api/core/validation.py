"""Every check a request meets before it reaches the engine, in one place: pydantic checks the
fields' types and ranges (api/core/protocol.py), this module everything else (an output constraint's
fields: api/core/constraints.py, called from here).

Sizes and ranges are found by field name on whatever request model a route parses, so a new
endpoint whose model has `n`, `stop` or `logprob_token_ids` is checked without new code here;
`check_chat` and `check_completion` hold what is particular to each endpoint. Each breach is
an `APIError` naming the offending `param`. The limits themselves live in `config.Limits`.
Which fields a body may send at all is api/core/fields.py's; the served model's facts the limits
depend on are api/core/bounds.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

from omlx_logprobs.api.core.bounds import ModelBounds
from omlx_logprobs.api.core.constraints import request_constraint
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.fields import UNSUPPORTED, first_unencodable
from omlx_logprobs.config import Limits
from omlx_logprobs.types import Constraint

# Fields that take a logprob count: chat's `top_logprobs`, completions' integer `logprobs`, vLLM's
# `prompt_logprobs`. A boolean `logprobs` (chat) is not a count.
COUNT_FIELDS = ("top_logprobs", "logprobs", "prompt_logprobs")
TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
# Below this, dividing a logit by the penalty can overflow float32 and poison the whole row.
MIN_REPETITION_PENALTY = 0.01


class RequestLimits:
    def __init__(self, limits: Limits, bounds: ModelBounds) -> None:
        self.limits = limits
        self.bounds = bounds

    # ---- before tokenizing ------------------------------------------------------------------
    def check_chat(self, req: Any) -> Constraint | None:
        """A chat request, before its template is rendered; its output constraint, compiled."""
        constraint = self.check(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true"
                " (add_generation_prompt defaults to true: send false to continue the final"
                " message).",
                param="continue_final_message",
            )
        return constraint

    def check_completion(self, req: Any) -> Constraint | None:
        """A completions request, before its prompts are read; its output constraint."""
        constraint = self.check(req)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if req.n < 1:
            raise APIError("n must be at least 1.", param="n")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n (no server-side ranking of choices).", "best_of")
        return constraint

    def check(self, req: BaseModel) -> Constraint | None:
        """Every check that needs no tokenizer, on any request model; its output constraint,
        compiled once here (a bad schema is refused before any template or tokenizer work)."""
        bad = first_unencodable(req, "")
        if bad is not None:
            raise APIError(f"{bad}: text must be valid Unicode (a lone surrogate)", param=bad)
        get = req.__dict__.get
        for u in UNSUPPORTED:
            if u.field in req.__dict__ and u.asks(get(u.field)):
                when = "not supported yet" if u.soon else "not supported by this server"
                raise APIError(
                    f"{u.field}: {u.why} is {when}.", param=u.field, code="unsupported_parameter"
                )
        self._counts(req)
        penalty = get("repetition_penalty")
        if penalty is not None and penalty < MIN_REPETITION_PENALTY:
            raise APIError(
                f"repetition_penalty must be at least {MIN_REPETITION_PENALTY}",
                param="repetition_penalty",
            )
        self._words(get("stop"), get("bad_words"))
        self._token_ids(get("stop_token_ids"), self.limits.max_stop_token_ids, "stop_token_ids")
        self._token_ids(
            get("logprob_token_ids"), self.limits.max_logprob_token_ids, "logprob_token_ids"
        )
        allowed = get("allowed_token_ids")
        if allowed is not None:
            if not allowed:
                raise APIError("allowed_token_ids must not be empty", param="allowed_token_ids")
            self._token_ids(allowed, self.bounds.vocab_size, "allowed_token_ids")
        truncate = get("truncate_prompt_tokens")
        if truncate is not None and (truncate == 0 or truncate > self.bounds.max_model_len):
            raise APIError(
                f"truncate_prompt_tokens must be -1 (the context, {self.bounds.max_model_len})"
                f" or from 1 to {self.bounds.max_model_len}, got {truncate}",
                param="truncate_prompt_tokens",
            )
        self._template_kwargs(get("chat_template_kwargs"))
        return request_constraint(req)

    def _counts(self, req: BaseModel) -> None:
        """n, the output token limits as sent, and the logprob counts (-1: the vocabulary)."""
        lim, get = self.limits, req.__dict__.get
        n = get("n")
        if n is not None:
            _at_most(n, lim.max_n, "n")
        for name in TOKEN_LIMIT_FIELDS:  # as sent: a route's own default is not the client's ask
            value = get(name) if name in req.model_fields_set else None
            if lim.max_output_tokens is not None and value is not None:
                _at_most(value, lim.max_output_tokens, name)
        for name in COUNT_FIELDS:
            value = get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                if value == -1:  # vLLM: the whole vocabulary (the cap decides whether it may)
                    value = self.bounds.vocab_size
                    setattr(req, name, value)
                _at_most(value, self.bounds.max_top_logprobs, name, "(--max-logprobs)")

    def _words(self, stop: str | list[str] | None, words: list[str] | None) -> None:
        """Stop strings and bad words: how many, how long, none empty."""
        lim = self.limits
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else list(stop)
            _at_most(len(stops), lim.max_stop, "stop", "stop strings")
            for i, s in enumerate(stops):
                _at_most(len(s), lim.max_stop_chars, f"stop[{i}]", "characters")
        if words:
            _at_most(len(words), lim.max_bad_words, "bad_words", "words")
            for i, w in enumerate(words):
                if not w.strip():
                    raise APIError(f"bad_words[{i}] must not be empty", param="bad_words")
                _at_most(len(w), lim.max_stop_chars, f"bad_words[{i}]", "characters")

    def _token_ids(self, ids: Iterable[int] | None, most: int, param: str) -> None:
        if ids is None:
            return
        ids = list(ids)
        _at_most(len(ids), most, param, "token ids")
        self.check_token_ids(ids, param)

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """Every id must be one of the model's (prompts given as ids, stop ids, scored ids)."""
        v = self.bounds.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < v:
                raise APIError(
                    f"{param}[{i}]: {t} is not a token id of this model (vocabulary {v})",
                    param=param,
                    code="invalid_token_id",
                )

    def _template_kwargs(self, kwargs: dict[str, Any] | None) -> None:
        # They reach apply_chat_template as keywords: none may replace one of its own parameters
        # (`chat_template` would run a client's template, `tokenize` would change the return type).
        for key in kwargs or {}:
            if key in self.bounds.template_params:
                raise APIError(
                    f"chat_template_kwargs may not set `{key}`", param="chat_template_kwargs"
                )

    # ---- around tokenizing ------------------------------------------------------------------
    def check_text(self, text: str, param: str) -> None:
        """Refuse text too long for the context before paying to tokenize it: no token is longer
        than max_token_bytes, so text over twice max_model_len such tokens can never fit."""
        most = 2 * self.bounds.max_token_bytes * self.bounds.max_model_len
        if len(text) > most or len(text.encode("utf-8", "surrogatepass")) > most:
            raise APIError(
                f"The prompt is far longer than this model's context of "
                f"{self.bounds.max_model_len} tokens.",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt(
        self, prompt_len: int, max_tokens: int | None, prompt_param: str, tokens_param: str
    ) -> int:
        """The prompt and max_tokens against the context window; returns the room left."""
        limit = self.bounds.max_model_len
        room = limit - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                f"This model's maximum context length is {limit} tokens; the prompt has"
                f" {prompt_len} and {tokens_param} asks for {max_tokens}.",
                param=prompt_param if room <= 0 else tokens_param,
                code="context_length_exceeded",
            )
        self._check_memory(prompt_len, max_tokens or 0, prompt_param, tokens_param)
        return room

    def _check_memory(self, prompt: int, more: int, prompt_param: str, tokens_param: str) -> None:
        """The keys and values the request's context needs against the memory the weights
        leave: a 400 with the numbers, never an allocation that fails in the engine."""
        b = self.bounds
        need = (prompt + more) * b.kv_bytes_per_token
        if not b.kv_bytes_per_token or need <= b.kv_budget_bytes:
            return
        raise APIError(
            f"This request's context needs about {need >> 20} MiB of keys and values"
            f" ({prompt} prompt tokens + {more} {tokens_param}, {b.kv_bytes_per_token} bytes a"
            f" token), more than the {b.kv_budget_bytes >> 20} MiB this machine has beside the"
            " model's weights: send a shorter prompt or ask for fewer tokens.",
            param=prompt_param
            if prompt * b.kv_bytes_per_token > b.kv_budget_bytes
            else tokens_param,
            code="context_length_exceeded",
        )

    # ---- values the engine takes --------------------------------------------------------------
    def logit_bias(self, raw: dict[str, float]) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in raw.items():
            try:
                tid = int(key)
            except ValueError:
                raise APIError(
                    f"logit_bias: key {key!r} is not a token id", param="logit_bias"
                ) from None
            if not 0 <= tid < self.bounds.vocab_size:
                raise APIError(
                    f"logit_bias: {tid} is not a token id of this model", param="logit_bias"
                )
            if not -100 <= value <= 100:
                raise APIError("logit_bias values must be in [-100, 100]", param="logit_bias")
            out.append((tid, float(value)))
        return tuple(out)

    def bad_words_ids(
        self, words: list[str] | None, encode: Callable[[str], list[int]]
    ) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, vLLM's way: the word without leading spaces, and again
        after one space when that starts with another token and has as many tokens (the word
        inside text, for tokenizers that fold the space into the next token)."""
        out: list[tuple[int, ...]] = []
        for i, word in enumerate(words or []):
            plain = encode(word.lstrip())
            if not plain:
                raise APIError(f"bad_words[{i}] has no tokens", param="bad_words")
            out.append(tuple(plain))
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(tuple(spaced))
        self.check_token_ids((t for w in out for t in w), "bad_words")
        return tuple(dict.fromkeys(out))

    def truncated(self, ids: list[int], truncate: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context's)."""
        if truncate is None:
            return ids
        keep = self.bounds.max_model_len if truncate == -1 else truncate
        return ids[-keep:] if len(ids) > keep else ids

    def tail_logprob(self, asked: bool, any_logprobs: bool) -> bool:
        """`return_tail_logprob` describes entries: it needs some to describe."""
        if asked and not any_logprobs:
            raise APIError(
                "return_tail_logprob needs logprobs or prompt_logprobs", param="return_tail_logprob"
            )
        return asked

    def logprob_token_ids(self, ids: list[int] | None, any_logprobs: bool) -> tuple[int, ...]:
        """The ids to report in place of a top list (their count and range: `check`)."""
        if ids is None:
            return ()
        param = "logprob_token_ids"
        if not any_logprobs:
            raise APIError("logprob_token_ids needs logprobs or prompt_logprobs", param=param)
        if not ids:
            raise APIError("logprob_token_ids must not be empty", param=param)
        if len(set(ids)) != len(ids):
            raise APIError("logprob_token_ids must be distinct", param=param)
        return tuple(ids)


def _at_most(value: int, most: int, param: str, what: str = "") -> None:
    if value > most:
        unit = f" {what}" if what else ""
        raise APIError(f"{param}: at most {most}{unit} allowed, got {value}", param=param)
