"""The engine's record of one choice of a request: prompt, progress, generated tokens, their
entries and released text. Private to the engine: the API sees `RequestOutput`s only."""

from __future__ import annotations

import itertools
from array import array
from enum import Enum
from typing import Any

from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.output.sections import SectionedText
from omlx_logprobs.parsing.tools import make_parser
from omlx_logprobs.types import (
    THINK_TAGS,
    EngineRequest,
    FinishReason,
    SamplingParams,
    ThinkStart,
    ToolParsing,
    image_namespace,
)

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # prompt not (fully) prefilled
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


class Sequence:
    """Plain Python state; the scheduler reads it, the model runner never stores it."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        think: ThinkStart = ThinkStart.OFF,
        choice_index: int = 0,
        prompt_store: LogprobStore | None = None,
        stream: bool = True,
        tools: ToolParsing | None = None,
        reasoning_tags: tuple[str, str] = THINK_TAGS,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.choice_index = choice_index  # seeds its own sampling: (seed, index, step)
        self.stream = stream  # outputs as tokens are released; else one output, at the end
        # Choices 1..n-1 of the same prompt: prefilled once through this sequence, then forked.
        self.forks: list[Sequence] = []
        # Entries for prompt positions 1..len-1 (position 0 has none), shared by the forks.
        if prompt_store is None and params.prompt_logprobs is not None:
            prompt_store = LogprobStore(params.num_prompt_top, params.tail_logprob)
        self.prompt_store = prompt_store
        self.status = Status.WAITING
        # What its next prefill computes: the prompt, or after a retraction (a pause that
        # dropped its keys and values, new weights) the prompt and the output so far.
        self.context_ids = prompt_ids
        self.num_prefilled = 0  # context tokens already in the KV cache
        self.cached_tokens = 0  # of those, taken from the prefix cache instead of computed
        self.output_ids = array("i")
        self.num_sampled = 0  # tokens sampled on the device, some perhaps not yet processed
        self.store = LogprobStore(params.num_top, params.tail_logprob) if params.logprobs else None
        self.think = think
        self.tools = tools
        self.reasoning_tags = reasoning_tags
        # The output index of its first reasoning token, once known (batch/budget.py reads it
        # for a thinking budget): 0 when the prompt opened reasoning.
        self.think_from: int | None = 0 if think is ThinkStart.INSIDE else None
        # reasoning, content and tool calls
        parser = make_parser(tools) if tools is not None else None
        single = tools is not None and not tools.parallel
        self.text = SectionedText(
            params.stop, think, parser, single, reasoning_tags, params.include_stop_str_in_output
        )
        self.token_ends = array("q")  # cumulative UTF-8 byte end of each generated token
        self.released_tokens = 0  # tokens whose text (and entry) has gone to the consumer
        self.prompt_released = False  # the prompt's entries went with an output
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # Its llguidance matcher when the output is constrained (runner/grammar.py): advanced by
        # the output processor, read for the next step's token mask.
        self.grammar: Any = None
        # The LoRA adapter's slot it runs on (runner/lora.py; 0: the base model), the same for
        # every choice of a request.
        self.adapter = 0
        self.adapter_version: Any = None  # its name and load (control.AdapterVersion), if any
        # The prefix cache's namespace (a hash of its cache_salt; 0: the default), the same for
        # every choice of a request: kept prefixes are looked up and kept under it.
        self.cache_namespace = 0
        # Its request's priority (lower first) and its place in the scheduler's order of
        # arrival (set there), which a retraction keeps.
        self.priority = 0
        self.arrival = 0
        # (first output token, weights) for each version its output met, when more than one
        self.weight_spans: list[tuple[int, Any]] = []
        # Drafts from its prediction the target accepted and rejected (runner/speculation.py).
        self.accepted_prediction_tokens = 0
        self.rejected_prediction_tokens = 0
        # Routed experts (runner/routing.py): a routing to replay on the prompt's first
        # positions, and what its forwards recorded, by first position (host arrays).
        self.replay: Any = None
        self.routes: dict[int, Any] = {}
        # An embedding request (EngineRequest.embed): its last position's hidden state on the
        # host once its prefill is collected (runner/pooling.py).
        self.embed = False
        self.embedding: Any = None
        # A vision model's images (types.ImageInput), whose embeddings its prefill puts at
        # their placeholder tokens (runner/vision.py).
        self.images: tuple[Any, ...] = ()

    @classmethod
    def of(cls, req: EngineRequest) -> Sequence:
        """The request's first choice; choices 1..n-1 are its forks."""
        seq = cls(
            req.request_id,
            req.prompt_ids,
            req.params,
            req.think,
            stream=req.stream,
            tools=req.tools,
            reasoning_tags=req.reasoning_tags,
        )
        # A prompt with images is kept and looked up under its images' hashes too.
        seq.cache_namespace = image_namespace(req.cache_namespace, req.images)
        seq.priority = req.priority
        seq.replay, seq.embed, seq.images = req.routed_experts, req.embed, req.images
        for i in range(1, req.n):
            seq.fork(i)
        return seq

    def fork(self, index: int) -> Sequence:
        """Choice `index` of the same request: it shares the prompt, its cache and its entries."""
        seq = Sequence(
            self.request_id,
            self.prompt_ids,
            self.params,
            self.think,
            choice_index=index,
            prompt_store=self.prompt_store,
            stream=self.stream,
            tools=self.tools,
            reasoning_tags=self.reasoning_tags,
        )
        seq.adapter, seq.adapter_version = self.adapter, self.adapter_version
        seq.cache_namespace, seq.priority = self.cache_namespace, self.priority
        seq.replay, seq.images = self.replay, self.images
        self.forks.append(seq)
        return seq

    @property
    def group(self) -> list[Sequence]:
        """This sequence and its forks, in choice order."""
        return [self, *self.forks]

    def joining(self) -> list[Sequence]:
        """The choices that enter the decode batch when this prompt is prefilled: those still
        waiting, none when nothing is to be generated (max_tokens 0)."""
        if self.params.max_tokens == 0:
            return []
        return [s for s in self.group if s.status is Status.WAITING]

    @property
    def prompt_len(self) -> int:
        """The length of what its prefill computes (the prompt, unless retracted)."""
        return len(self.context_ids)

    @property
    def scored(self) -> bool:
        """Its prefill computes prompt entries (never again after a retraction)."""
        return self.prompt_store is not None and self.context_ids is self.prompt_ids

    def retract(self) -> None:
        """Back to waiting, to be prefilled again from its prompt and output (its cache rows
        were freed): a choice of its own from here on, its sampling stream where it was."""
        self.context_ids = self.prompt_ids + self.output_ids.tolist()
        self.num_prefilled = 0
        self.forks = []
        self.seq_id = next(_ids)  # a new row everywhere (and for a split model's other ranks)
        self.status = Status.WAITING

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def to_write(self) -> int:
        """Tokens it may still write into its KV cache: each sampled token but the last."""
        return self.params.max_tokens - self.num_sampled

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
