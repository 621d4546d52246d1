"""One request, whatever API it came through, made ready for the engine.

Every route reads its wire shape into a chat or completions request model and says, in an
`Ask`, what it wants beyond those fields (how many tokens, which logprobs, what its own fields
are called). `prepare` then does everything once: the checks (api/core/validation.py), the output
constraint compiled (api/core/constraints.py; with tools, api/core/tools.py), the prompt's ids
(api/core/prompts.py), the `SamplingParams`, the `EngineRequest`s and the writer of the request's
logprobs (logprobs/wire.py). A 400 names the field as the client sent it (`Ask.names`).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from omlx_logprobs.api.core import tools
from omlx_logprobs.api.core.constraints import constraint_field
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import image_parts
from omlx_logprobs.api.core.prediction import prediction_ids
from omlx_logprobs.api.core.prompts import (
    completion_prompts,
    encode,
    faithful_chat_prompt,
    image_chat_prompt,
    token_images,
)
from omlx_logprobs.api.core.protocol import (
    ChatCompletionRequest,
    ChatTokensRequest,
    CompletionRequest,
    SamplingKnobs,
)
from omlx_logprobs.api.core.routed_experts import with_routing
from omlx_logprobs.api.core.sampled import Recorder
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.thinking_budget import with_thinking_budget
from omlx_logprobs.logprobs.wire import LogprobWriter
from omlx_logprobs.parsing.thinking import think_start
from omlx_logprobs.transport.client import RequestHandle
from omlx_logprobs.types import (
    Constraint,
    EngineRequest,
    ImageInput,
    LogprobsMode,
    RequestOutput,
    SamplingParams,
    ThinkStart,
    cache_namespace,
)


@dataclass(frozen=True)
class Ask:
    """What a route asks, in no endpoint's words: the request's fields (a chat or completions
    request model, which every API's body is read into), its output budget, whether generated
    tokens get entries and how many alternatives, how many alternatives prompt positions get
    (None: no prompt logprobs), the request id's prefix, and the wire's names of the fields
    (`{"max_tokens": "max_output_tokens"}`, and the prompt's: `token_ids`) for the 400s;
    `sampled`: the ids earlier answers were sampled as, by their message's index, where the route
    knows them (a Responses continuation: api/core/splice.py puts them in the prompt). The
    token routes (vLLM's and SGLang's generate) ask with their sampling fields alone (`req` a
    `SamplingKnobs`) and take only `sampling_params` of this path: their prompts are ids."""

    req: SamplingKnobs
    max_tokens: int | None
    logprobs: bool
    top: int
    prompt_top: int | None = None
    prefix: str = "chatcmpl-"
    names: Mapping[str, str] = field(default_factory=dict)
    prompt_param: str | None = None
    sampled: Mapping[int, Sequence[int]] = field(default_factory=dict)

    @staticmethod
    def chat(
        req: ChatCompletionRequest,
        prefix: str = "chatcmpl-",
        names: Mapping[str, str] | None = None,
    ) -> Ask:
        """vLLM: chat `echo` scores the prompt too (top_logprobs alternatives), unless
        streamed (a stream has no place for them)."""
        prompt_top = req.prompt_logprobs
        if prompt_top is None and req.echo and not req.stream:
            prompt_top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens or req.max_tokens
        top = req.top_logprobs or 0
        return Ask(req, max_tokens, req.logprobs, top, prompt_top, prefix, names or {})

    @staticmethod
    def completion(req: CompletionRequest) -> Ask:
        """Echo with logprobs needs the prompt's entries, with as many alternatives."""
        prompt_top = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_top = max(prompt_top or 0, req.logprobs)
        logprobs = req.logprobs is not None
        return Ask(req, req.max_tokens, logprobs, req.logprobs or 0, prompt_top, "cmpl-")


@dataclass(frozen=True)
class Prepared:
    """A request ready to run: one `EngineRequest` per prompt (chat: one; its n choices are
    prefilled once), the constraint they share as compiled, and the writer of its logprobs."""

    request_id: str  # the response's id (completions: its prompts' requests add `-i`)
    requests: tuple[EngineRequest, ...]
    constraint: Constraint | None
    writer: LogprobWriter
    model: str  # the name its responses carry: the adapter's, or the model's
    # Prompt ids that are earlier answers' sampled ids (api/core/splice.py), and what
    # remembers this request's answers for the conversations sent back (chat requests).
    reused: int = 0
    recorder: Recorder | None = None

    @property
    def first(self) -> EngineRequest:
        return self.requests[0]

    def submit(self, served: Served) -> list[RequestHandle]:
        return [served.engine.submit(r) for r in self.requests]

    def heard(self, out: RequestOutput) -> None:
        """An output of this request (a streamed delta or a merged whole): a finished answer's
        sampled ids are remembered under its text."""
        if self.recorder is not None:
            self.recorder.heard(out)


def prepare(ask: Ask, served: Served) -> Prepared:
    """Check, compile and tokenize once; a 400 names the wire's field."""
    rid = f"{ask.prefix}{uuid.uuid4().hex}"
    req = ask.req
    assert isinstance(req, (ChatCompletionRequest, CompletionRequest))
    with wire_names(ask.names):
        served.check_model(req.model)
        reused, recorder = 0, None
        if isinstance(req, ChatCompletionRequest):
            requests, constraint, reused = _chat(ask, req, served, rid)
            if served.sampled.count:  # --faithful-answers 0: nothing to remember answers in
                recorder = Recorder(served.sampled, served.adapter(req.model) or "")
        else:
            requests, constraint = _completion(ask, req, served, rid)
    writer = served.writers.choose(req.logprobs_format, req.return_tokens_as_token_ids)
    model = served.adapter(req.model) or served.model.name
    return Prepared(rid, requests, constraint, writer, model, reused, recorder)


async def prepared(ask: Ask, served: Served) -> Prepared:
    """`prepare`, in a worker thread when the request has images: reading them (an http(s)
    one fetched, within its bounds), decoding them and the processor's pass take from
    milliseconds to seconds, which the event loop, and every stream on it, must not wait for.
    A text request is prepared on the loop (a thread's hop costs more than its tokenizing)."""
    req = ask.req
    if isinstance(req, ChatCompletionRequest) and image_parts(req.messages):
        return await asyncio.to_thread(prepare, ask, served)
    return prepare(ask, served)


def _chat(
    ask: Ask, req: ChatCompletionRequest, served: Served, rid: str
) -> tuple[tuple[EngineRequest, ...], Constraint | None, int]:
    tokenizer = served.model.tokenizer
    content = served.checks.check_chat(req)
    parsing = tools.tool_parsing(req, served.tool_format, tokenizer)
    prompt, reused, images = _chat_prompt(req, served, ask.sampled)
    params = sampling_params(ask, served, len(prompt), content)
    params, replay = with_routing(req, served, len(prompt), params)
    if req.prediction is not None:
        params = replace(params, prediction=prediction_ids(req.prediction, served.model))
    # tool_choice required or named, or a constraint beside tools: the calls' grammar
    constraint = tools.tool_constraint(req, parsing, tokenizer, content)
    if constraint is not content:
        params = replace(params, constraint=constraint)
    params = with_thinking_budget(req, served, params)
    tail = tokenizer.decode(prompt[-8:])
    think = think_start(served.reasoning, tail, served.reasoning_tags[0])
    if constraint is not None and think is ThinkStart.INSIDE:
        # The grammar applies from the first generated token: here that is reasoning.
        raise APIError(
            "Constrained output cannot follow reasoning yet: the prompt opens <think>, so"
            " the constrained text would be the reasoning. Turn thinking off (for example"
            ' chat_template_kwargs {"enable_thinking": false}).',
            param=constraint_field(req) or "tool_choice",
        )
    ereq = EngineRequest(
        rid,
        prompt,
        params,
        req.n,
        think=think,
        stream=req.stream,
        tools=parsing,
        reasoning_tags=served.reasoning_tags,
        adapter=served.adapter(req.model),
        cache_namespace=cache_namespace(req.cache_salt),
        priority=req.priority,
        routed_experts=replay,
        images=images,
    )
    return (ereq,), constraint, reused


def _chat_prompt(
    req: ChatCompletionRequest, served: Served, known: Mapping[int, Sequence[int]]
) -> tuple[list[int], int, tuple[ImageInput, ...]]:
    """The chat template's ids of the messages, earlier answers this server sampled spliced in
    as their sampled ids (and how many ids those are), or, on /v1/chat/completions/tokens, the
    ids the client sent (the conversation as its trainer holds it: never re-tokenized); with
    images, the processor's ids and the images (api/core/images.py)."""
    parts = image_parts(req.messages)
    if isinstance(req, ChatTokensRequest):
        served.checks.check_token_ids(req.tokens, "tokens")
        ids = served.checks.truncated(list(req.tokens), req.truncate_prompt_tokens)
        return ids, 0, token_images(req, served, parts, ids) if parts else ()
    if parts:
        return image_chat_prompt(req, served, parts, known)
    return *faithful_chat_prompt(req, served, known), ()


def _completion(
    ask: Ask, req: CompletionRequest, served: Served, rid: str
) -> tuple[tuple[EngineRequest, ...], Constraint | None]:
    """Everything checked first, then one request per prompt (its n choices from one
    prefill)."""
    constraint = served.checks.check_completion(req)
    prompts = completion_prompts(req, served.model, served.checks)
    adapter = served.adapter(req.model)
    requests = []
    for i, ids in enumerate(prompts):
        params = sampling_params(ask, served, len(ids), constraint)
        params, replay = with_routing(req, served, len(ids), params)  # each prompt's own length
        requests.append(
            EngineRequest(
                f"{rid}-{i}",
                ids,
                params,
                req.n,
                stream=req.stream,
                adapter=adapter,
                cache_namespace=cache_namespace(req.cache_salt),
                priority=req.priority,
                routed_experts=replay,
            )  # fmt: skip
        )
    return tuple(requests), constraint


def sampling_params(
    ask: Ask, served: Served, prompt_len: int, constraint: Constraint | None
) -> SamplingParams:
    """The request's fields as SamplingParams; a 400 for every value the engine cannot take
    (the checks live in api/core/validation.py; the top-K caps are checked there, once)."""
    req = ask.req
    checks = served.checks
    chat = isinstance(req, ChatCompletionRequest)
    completion = getattr(req, "max_completion_tokens", None) is not None
    tokens_param = "max_completion_tokens" if completion else "max_tokens"
    prompt_param = ask.prompt_param or ("messages" if chat else "prompt")
    room = checks.check_prompt(prompt_len, ask.max_tokens, prompt_param, tokens_param)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    any_logprobs = ask.logprobs or ask.prompt_top is not None
    # vLLM's default is the context left; --max-output-tokens bounds every request's output,
    # sent or not (a value sent above it is a 400 already: validation.py), and a route's own
    # default (completions' 16, SGLang's 128) too.
    limit = ask.max_tokens if ask.max_tokens is not None else room
    cap = checks.limits.max_output_tokens
    if cap is not None:
        limit = min(limit, cap)
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
        logprobs=ask.logprobs,
        top_logprobs=ask.top,
        prompt_logprobs=ask.prompt_top,
        logprob_token_ids=checks.logprob_token_ids(req.logprob_token_ids, any_logprobs),
        logprobs_mode=LogprobsMode(req.logprobs_mode or served.cfg.logprobs_mode),
        tail_logprob=checks.tail_logprob(req.return_tail_logprob, any_logprobs),
        min_tokens=req.min_tokens,
        allowed_token_ids=tuple(sorted(set(req.allowed_token_ids or ()))),
        bad_words_ids=checks.bad_words_ids(
            req.bad_words, lambda w: encode(served.model, w, "bad_words")
        ),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        constraint=constraint,
    )


@contextmanager
def wire_names(names: Mapping[str, str]) -> Iterator[None]:
    """A 400 raised inside names the client's field: the request models' names (`max_tokens`)
    become the wire's (`max_output_tokens`), in `param` and in the message."""
    try:
        yield
    except APIError as e:
        if not names:
            raise
        head = (e.param or "").split(".")[0].split("[")[0]
        if head in names:
            e.param = names[head] + (e.param or "")[len(head) :]
        for ours, theirs in names.items():
            e.message = re.sub(rf"\b{re.escape(ours)}\b", theirs, e.message)
        raise
