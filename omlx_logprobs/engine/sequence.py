"""The engine's record of one request: prompt, progress, generated tokens and released text."""

from __future__ import annotations

import itertools
from array import array
from enum import Enum

from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.output.detokenizer import IncrementalText
from omlx_logprobs.types import FinishReason, SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # prompt not (fully) prefilled
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


class Sequence:
    """Plain Python state; the scheduler reads it, the model runner never stores it."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.status = Status.WAITING
        self.num_prefilled = 0  # prompt tokens already in the KV cache
        self.output_ids = array("i")
        self.num_sampled = 0  # tokens sampled on the device, some perhaps not yet processed
        self.store = LogprobStore(params.top_logprobs) if params.logprobs else None
        self.text = IncrementalText(params.stop)
        self.token_ends = array("q")  # cumulative UTF-8 byte end of each generated token
        self.released_tokens = 0  # tokens whose text (and entry) has gone to the consumer
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= self.prompt_len

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
