"""From a validated request to engine work and back: prompt building, parameter checks, and the
JSON and SSE bodies of chat completions."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

from fastapi import Request
from pydantic import BaseModel

import omlx_logprobs
from omlx_logprobs.api import sections, tools
from omlx_logprobs.api.constraints import constraint_field, request_constraint
from omlx_logprobs.api.errors import APIError, error_body
from omlx_logprobs.api.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from omlx_logprobs.api.validation import RequestLimits, check_unknown, model_bounds
from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.engine.client import EngineClient, RequestHandle, merged
from omlx_logprobs.logprobs.columnar import encode_block
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.parsing.thinking import think_start
from omlx_logprobs.types import (
    THINK_TAGS,
    EngineRequest,
    Entries,
    LogprobsMode,
    RequestOutput,
    SamplingParams,
    ThinkStart,
    WeightVersion,
)

log = logging.getLogger("omlx_logprobs")
IGNORED_HEADER = "X-Ignored-Fields"  # with --ignore-unknown-fields: what a request sent in vain


@dataclass(frozen=True)
class Served:
    """Everything a route needs: the engine, the model's facts and the server's limits."""

    engine: EngineClient
    model: LoadedModel
    cfg: EngineConfig
    reasoning: bool = False  # the thinking parser is on (--reasoning-parser)
    tool_format: str = "none"  # the tool-call format parsed (--tool-call-parser, resolved)
    reasoning_tags: tuple[str, str] = THINK_TAGS  # <think> </think>, or harmony's analysis
    limits: Limits = field(default_factory=Limits)
    ignore_unknown_fields: bool = False  # --ignore-unknown-fields: warn instead of a 400
    # LoRA adapters served on this model, name -> path (api/pool.py keeps it across reloads);
    # a request names one by `model`.
    adapters: dict[str, str] = field(default_factory=dict)

    @cached_property
    def checks(self) -> RequestLimits:
        return RequestLimits(self.limits, model_bounds(self.model, self.cfg.max_top_logprobs))

    @cached_property
    def fingerprint(self) -> str:
        """`system_fingerprint`: changes when what answers does (this server's version, the
        model, the engine's settings), as OpenAI's does with its backend."""
        facts = f"{omlx_logprobs.__version__}|{self.model.name}|{self.model.path}|{self.cfg}"
        return "fp_" + hashlib.sha256(facts.encode()).hexdigest()[:12]

    def fields_headers(self, req: BaseModel) -> dict[str, str]:
        return fields_headers(req, self.ignore_unknown_fields)

    def adapter(self, name: str) -> str | None:
        """The LoRA adapter a request's `model` names, None for the model itself."""
        return name if name != self.model.name and name in self.adapters else None

    def check_model(self, name: str) -> None:
        if name != self.model.name and name not in self.adapters:
            raise APIError(
                f"The model `{name}` does not exist. This server serves `{self.model.name}`.",
                param="model",
                status=404,
                code="model_not_found",
            )


def fields_headers(req: BaseModel, ignore: bool) -> dict[str, str]:
    """A 400 for the first field the request's model does not declare; with `ignore`
    (--ignore-unknown-fields) a warning and the response header naming them all."""
    ignored = check_unknown(req, ignore)
    if not ignored:
        return {}
    log.warning("ignored unknown request fields: %s", ", ".join(ignored))
    return {IGNORED_HEADER: ", ".join(ignored)}


def sampling_params(
    req: SamplingFields,
    served: Served,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Request fields as SamplingParams; a 400 for every value the engine cannot take (the
    checks live in api/validation.py). `prompt_logprobs` is what the engine computes (the
    caller may ask more than the field)."""
    checks = served.checks
    completion = getattr(req, "max_completion_tokens", None) is not None
    tokens_param = "max_completion_tokens" if completion else "max_tokens"
    prompt_param = "messages" if hasattr(req, "messages") else "prompt"
    room = checks.check_prompt(prompt_len, max_tokens, prompt_param, tokens_param)
    cap = served.cfg.max_top_logprobs
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


def reply_role(req: ChatCompletionRequest) -> str:
    """The role of the message generated (vLLM): a new assistant turn, or, without a
    generation prompt, more of the last message."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echo_text(req: ChatCompletionRequest) -> str:
    """Chat `echo` (vLLM): the last message's text, when it is of the reply's role."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == reply_role(req) else ""


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


async def wait_or_disconnect(handles: list[RequestHandle], raw: Request) -> list[RequestOutput]:
    """Every choice's merged outputs once all have finished, in order; ConnectionAbortedError if
    the client goes away first (the caller aborts what is unfinished)."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    async def collect_all() -> list[RequestOutput]:
        finals = await asyncio.gather(*[h.final() for h in handles])
        return [out for outs in finals for out in outs]

    task = asyncio.ensure_future(collect_all())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            raise ConnectionAbortedError("client disconnected")
    return task.result()


def usage(outs: list[RequestOutput], reasoning: bool = False) -> dict[str, Any]:
    """The `usage` object of a response: each prompt counted once however many choices it has
    (its first choice's count), every generated token counted; with the thinking parser on,
    the reasoning tokens among them (else 0)."""
    firsts = [o for o in outs if o.index == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(o.cached_tokens for o in firsts),
            "audio_tokens": 0,
        },
        "completion_tokens_details": {  # OpenAI's keys, always present
            "reasoning_tokens": sum(o.reasoning_tokens for o in outs) if reasoning else 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


@lru_cache(maxsize=64)
def weight_version_json(version: WeightVersion) -> str:
    """`"weight_version":{...}`, the fragment every body and chunk carries: which weights made
    it (one version for a whole response: the engine swaps weights only while nothing runs)."""
    return f',"weight_version":{json.dumps(version.json())}'


def raise_if_failed(outs: list[RequestOutput]) -> None:
    for out in outs:
        if out.error:
            raise APIError(out.error, status=500, type_="server_error")


def prompt_logprobs_json(
    req: SamplingFields,
    e: Entries,
    fmts: tuple[PromptLogprobFormatter, ...],
    asked: int | None = None,
) -> str:
    """vLLM's `prompt_logprobs` (a list with null for the first position), or in the compact
    form one block of the positions after the first. `asked`: the alternatives wanted, when
    not the field's (chat echo asks for them)."""
    fixed = bool(req.logprob_token_ids)
    k = e.k if fixed else ((req.prompt_logprobs if asked is None else asked) or 0)
    if req.logprobs_format != "openai":
        return encode_block(e, k, req.logprobs_format)
    return fmts[req.return_tokens_as_token_ids].json(e, k, fixed)


class ChatServing:
    def __init__(self, served: Served) -> None:
        self.served = served
        vocab = served.model.vocab
        self.formatters = (ChatLogprobFormatter(vocab), ChatLogprobFormatter(vocab, as_ids=True))
        self.prompt_formatters = (
            PromptLogprobFormatter(vocab),
            PromptLogprobFormatter(vocab, as_ids=True),
        )

    def _start(self, req: ChatCompletionRequest) -> tuple[EngineRequest, RequestHandle]:
        served = self.served
        served.check_model(req.model)
        served.checks.check_chat(req)
        parsing = tools.tool_parsing(req, served.tool_format, served.model.tokenizer)
        forced = tools.forced_call(req, parsing, served.model.tokenizer)
        prompt = chat_prompt(req, served.model, served.checks)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling_params(
            req,
            served,
            len(prompt),
            max_tokens,
            req.logprobs,
            req.top_logprobs or 0,
            self._prompt_logprobs(req),
        )
        if forced is not None:  # tool_choice required or named: the calls' grammar
            params = replace(params, constraint=forced)
        tail = served.model.tokenizer.decode(prompt[-8:])
        think = think_start(served.reasoning, tail, served.reasoning_tags[0])
        if params.constraint is not None and think is ThinkStart.INSIDE:
            # The grammar applies from the first generated token: here that is reasoning.
            raise APIError(
                "Constrained output cannot follow reasoning yet: the prompt opens <think>, so"
                " the constrained text would be the reasoning. Turn thinking off (for example"
                ' chat_template_kwargs {"enable_thinking": false}).',
                param=constraint_field(req) or "tool_choice",
            )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
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
        )
        return ereq, served.engine.submit(ereq)

    @staticmethod
    def _prompt_logprobs(req: ChatCompletionRequest) -> int | None:
        """vLLM: chat `echo` scores the prompt too (top_logprobs alternatives), unless streamed
        (a stream has no place for them)."""
        if req.prompt_logprobs is None and req.echo and not req.stream:
            return req.top_logprobs or 0
        return req.prompt_logprobs

    def _head(self, ereq: EngineRequest, kind: str) -> str:
        served = self.served
        return (
            f'{{"id":"{ereq.request_id}","object":"{kind}","created":{int(time.time())},'
            f'"model":{json.dumps(ereq.adapter or served.model.name)},'
            f'"system_fingerprint":"{served.fingerprint}",'
        )

    async def complete(self, req: ChatCompletionRequest, raw: Request) -> str:
        ereq, handle = self._start(req)
        think = ereq.think
        try:
            outs = await wait_or_disconnect([handle], raw)
        finally:
            handle.abort()
        raise_if_failed(outs)
        role, echo = reply_role(req), echo_text(req)
        parser = ereq.tools.parser if ereq.tools else None
        named = isinstance(req.tool_choice, NamedToolChoice)
        choices = []
        for out in outs:
            lp = self._logprobs_json(req, out, ereq)
            calls = tools.CallIds(parser).message(out.tool_calls)
            body = sections.message(out, think, calls)
            if echo:
                body["content"] = echo + (body.get("content") or "")
            message = json.dumps({"role": role, **body}, ensure_ascii=False)
            reason = out.finish_reason.value if out.finish_reason else None
            finish = json.dumps(tools.finish_reason(reason, bool(calls), named))
            ids = ""
            if req.return_token_ids:
                ids = f',"token_ids":{json.dumps(out.token_ids.tolist())}'
            choices.append(
                f'{{"index":{out.index},"message":{message},"logprobs":{lp},'
                f'"finish_reason":{finish}{ids}}}'
            )
        extra = ""
        if req.return_token_ids:
            extra = f',"prompt_token_ids":{json.dumps(ereq.prompt_ids)}'
        scored = outs[0].prompt_logprobs
        asked = ereq.params.prompt_logprobs
        if asked is not None and scored is not None:
            entries = prompt_logprobs_json(req, scored, self.prompt_formatters, asked)
            extra += f',"prompt_logprobs":{entries}'
        body = usage(outs, think is not ThinkStart.OFF)
        return (
            f'{self._head(ereq, "chat.completion")}"choices":[{",".join(choices)}],'
            f'"usage":{json.dumps(body)}{extra}{weight_version_json(outs[0].weight_version)}}}'
        )

    def _logprobs_json(
        self, req: ChatCompletionRequest, out: RequestOutput, ereq: EngineRequest
    ) -> str:
        """The entries of out's tokens; with the thinking parser on, reasoning tokens apart
        (reasoning comes first); with tool calls parsed, the calls' tokens apart (they come
        last)."""
        e = out.logprobs
        if e is None:
            return "null"
        head = "{"
        entries: Callable[[Entries], str] = self.formatters[req.return_tokens_as_token_ids].entries
        if (encoding := req.logprobs_format) != "openai":
            head = f'{{"format":"{encoding}",'

            def entries(rows: Entries) -> str:
                return encode_block(rows, e.k, encoding)

        if ereq.think is ThinkStart.OFF and ereq.tools is None:
            return head + '"content":' + entries(e) + ',"refusal":null}'
        r, t = out.num_reasoning, len(e) - out.num_tool
        body = f'{head}"content":{entries(e.rows(r, t))},'
        if ereq.think is not ThinkStart.OFF:
            body += f'"reasoning_content":{entries(e.rows(0, r))},'
        if ereq.tools is not None:
            body += f'"tool_calls":{entries(e.rows(t, len(e)))},'
        return body + '"refusal":null}'

    def stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        ereq, handle = self._start(req)  # errors raise here, before the 200 starts
        return self._events(req, ereq, handle)

    async def _events(
        self, req: ChatCompletionRequest, ereq: EngineRequest, handle: RequestHandle
    ) -> AsyncIterator[str]:
        head = self._head(ereq, "chat.completion.chunk")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tail = ',"usage":null}' if include_usage else "}"
        think = ereq.think

        def chunk(
            i: int, delta: dict[str, Any], logprobs: str, finish: str | None, extra: str = ""
        ) -> str:
            d = json.dumps(delta, ensure_ascii=False)
            fin = json.dumps(finish)
            choice = (
                f'{{"index":{i},"delta":{d},"logprobs":{logprobs},"finish_reason":{fin}{extra}}}'
            )
            return f'data: {head}"choices":[{choice}]{tail}\n\n'

        ids = req.return_token_ids
        role, echo = reply_role(req), echo_text(req)
        finals: dict[int, RequestOutput] = {}
        parser = ereq.tools.parser if ereq.tools else None
        numbering = [tools.CallIds(parser) for _ in range(ereq.n)]  # call ids per choice
        named = isinstance(req.tool_choice, NamedToolChoice)
        try:
            first = f',"prompt_token_ids":{json.dumps(ereq.prompt_ids)}' if ids else ""
            stream = merged([handle])
            _, head_out = await anext(stream)  # the role chunks name the weights: they wait
            tail = weight_version_json(head_out.weight_version) + tail
            for i in range(ereq.n):  # prompt_token_ids once, with the first chunk (vLLM)
                yield chunk(i, {"role": role, "content": ""}, "null", None, first if i == 0 else "")
            if echo:  # vLLM: the echoed text in a chunk of its own, before the generated text
                for i in range(ereq.n):
                    yield chunk(i, {"content": echo}, "null", None)
            async for out in _starting_with(head_out, stream):
                i = out.index
                if out.error:
                    finals[i] = out
                    err = error_body(out.error, "server_error", None, None)
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                if out.text or out.reasoning_text or out.num_tokens or out.tool_calls:
                    lp = self._logprobs_json(req, out, ereq)
                    extra = f',"token_ids":{json.dumps(out.token_ids.tolist())}' if ids else ""
                    calls = numbering[i].delta(out.tool_calls)
                    yield chunk(i, sections.delta(out, think, calls), lp, None, extra)
                if out.finished:
                    finals[i] = out
                    reason = out.finish_reason.value if out.finish_reason else None
                    called = numbering[i].count > 0
                    finish = tools.finish_reason(reason, called, named)
                    yield chunk(i, {}, "null", finish)
            if include_usage:
                done = [finals[i] for i in sorted(finals)]
                body = json.dumps(usage(done, think is not ThinkStart.OFF))
                w = weight_version_json(done[0].weight_version)
                yield f'data: {head}"choices":[],"usage":{body}{w}}}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            handle.abort()


async def _starting_with(
    first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[RequestOutput]:
    """`first`, then the outputs `merged` still has."""
    yield first
    async for _, out in rest:
        yield out
