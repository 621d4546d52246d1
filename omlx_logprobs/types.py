"""Typed records that cross module boundaries. No mlx here: the scheduler and API import these."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum


class LogprobsMode(str, Enum):
    """Which distribution logprobs describe (vLLM's names)."""

    RAW = "raw_logprobs"  # after logit processors, before temperature and truncation
    PROCESSED = "processed_logprobs"  # what was sampled from: scaled, truncated, renormalised


MAX_N = 16  # choices per prompt
MAX_LOGPROB_TOKEN_IDS = 128


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the logprob extractor."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's entry and a top k
    logprob_token_ids: tuple[int, ...] = ()  # reported in place of the natural top list
    logprobs_mode: LogprobsMode = LogprobsMode.RAW

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.top_logprobs < 0 or (self.top_logprobs and not self.logprobs):
            raise ValueError("top_logprobs needs logprobs and must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"at most {MAX_LOGPROB_TOKEN_IDS} logprob_token_ids")
        if len(set(self.logprob_token_ids)) != len(self.logprob_token_ids):
            raise ValueError("logprob_token_ids must be distinct")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution (needs a sort of the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def processed(self) -> bool:
        return self.logprobs_mode is LogprobsMode.PROCESSED

    @property
    def num_top(self) -> int:
        """Entries per generated position besides the sampled one: the fixed ids or the top K."""
        return len(self.logprob_token_ids) or self.top_logprobs

    @property
    def num_prompt_top(self) -> int:
        return len(self.logprob_token_ids) or (self.prompt_logprobs or 0)

    @property
    def penalizes(self) -> bool:
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
        )

    def with_max_tokens(self, n: int) -> SamplingParams:
        return replace(self, max_tokens=n)


@dataclass
class RequestOutput:
    """A delta for one request: what was released since the last output the consumer took.

    Token entries are addressed as the range [first_token, end_token) of the request's own flat
    stores, so merging two deltas is a concatenation of text and a widening of the range.
    Reasoning precedes content: entries before `content_start` (an absolute token index, clamped
    to the range) are reasoning tokens, the rest content tokens.
    """

    request_id: str
    text: str  # content
    first_token: int
    end_token: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    error: str | None = None
    reasoning_text: str = ""
    content_start: int = 0  # the request's reasoning tokens so far: those before it; 0: none

    @property
    def split_token(self) -> int:
        """The first content token of this delta's range: [first, split) reasoning, [split, end)
        content."""
        return min(max(self.content_start, self.first_token), self.end_token)

    def merge(self, later: RequestOutput) -> RequestOutput:
        # Reasoning tokens come first: the count of reasoning tokens is this delta's unless all
        # of its tokens were reasoning (then the later one knows at least as many).
        split = self.content_start if self.split_token < self.end_token else later.content_start
        return RequestOutput(
            request_id=self.request_id,
            text=self.text + later.text,
            reasoning_text=self.reasoning_text + later.reasoning_text,
            content_start=split,
            first_token=self.first_token,
            end_token=later.end_token,
            finished=later.finished,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            cached_tokens=later.cached_tokens,
            completion_tokens=later.completion_tokens,
            error=later.error or self.error,
        )


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know about the loaded model."""

    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
