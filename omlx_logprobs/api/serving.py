"""From a validated request to engine work and back: prompt building, parameter checks, and the
JSON and SSE bodies of chat completions."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from fastapi import Request

from omlx_logprobs.api import sections, tools
from omlx_logprobs.api.errors import APIError, error_body
from omlx_logprobs.api.protocol import ChatCompletionRequest, SamplingFields
from omlx_logprobs.api.validation import RequestLimits, model_bounds
from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.engine.client import EngineClient, RequestHandle
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

    @cached_property
    def checks(self) -> RequestLimits:
        return RequestLimits(self.limits, model_bounds(self.model, self.cfg.max_top_logprobs))

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise APIError(
                f"The model `{name}` does not exist. This server serves `{self.model.name}`.",
                param="model",
                status=404,
                code="model_not_found",
            )


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
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else room,
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
    )


def chat_prompt(
    req: ChatCompletionRequest, model: LoadedModel, checks: RequestLimits | None = None
) -> list[int]:
    messages = tools.template_messages(req.messages)
    try:
        text = model.tokenizer.apply_chat_template(
            messages,
            tools=tools.template_tools(req.tools),
            add_generation_prompt=True,
            tokenize=False,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # a template error is the request's fault
        raise APIError(
            f"The chat template could not render these messages: {e}", param="messages"
        ) from None
    if checks is not None:
        checks.check_text(text, "messages")
    return encode(model, text, "messages")


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
    the reasoning tokens among them."""
    firsts = [o for o in outs if o.index == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outs)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)},
    }
    if reasoning:
        body["completion_tokens_details"] = {
            "reasoning_tokens": sum(o.reasoning_tokens for o in outs)
        }
    return body


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
    req: SamplingFields, e: Entries, fmts: tuple[PromptLogprobFormatter, ...]
) -> str:
    """vLLM's `prompt_logprobs` (a list with null for the first position), or in the compact
    form one block of the positions after the first."""
    fixed = bool(req.logprob_token_ids)
    k = e.k if fixed else (req.prompt_logprobs or 0)
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
        parsing = tools.tool_parsing(req, served.tool_format)
        prompt = chat_prompt(req, served.model, served.checks)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling_params(
            req,
            served,
            len(prompt),
            max_tokens,
            req.logprobs,
            req.top_logprobs or 0,
            req.prompt_logprobs,
        )
        tail = served.model.tokenizer.decode(prompt[-8:])
        think = think_start(served.reasoning, tail, served.reasoning_tags[0])
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        ereq = EngineRequest(
            rid,
            prompt,
            params,
            think=think,
            stream=req.stream,
            tools=parsing,
            reasoning_tags=served.reasoning_tags,
        )
        return ereq, served.engine.submit(ereq)

    async def complete(self, req: ChatCompletionRequest, raw: Request) -> str:
        ereq, handle = self._start(req)
        think = ereq.think
        try:
            [out] = await wait_or_disconnect([handle], raw)
        finally:
            handle.abort()
        raise_if_failed([out])
        lp = self._logprobs_json(req, out, ereq)
        calls = tools.CallIds(ereq.tools.parser if ereq.tools else None).message(out.tool_calls)
        message = json.dumps(
            {"role": "assistant", **sections.message(out, think, calls)}, ensure_ascii=False
        )
        reason = out.finish_reason.value if out.finish_reason else None
        finish = json.dumps(tools.finish_reason(reason, bool(calls)))
        ids = ""
        if req.return_token_ids:
            ids = f',"token_ids":{json.dumps(out.token_ids.tolist())}'
        choice = f'{{"index":0,"message":{message},"logprobs":{lp},"finish_reason":{finish}{ids}}}'
        extra = ""
        if req.return_token_ids:
            extra = f',"prompt_token_ids":{json.dumps(ereq.prompt_ids)}'
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            scored = prompt_logprobs_json(req, out.prompt_logprobs, self.prompt_formatters)
            extra += f',"prompt_logprobs":{scored}'
        body = usage([out], think is not ThinkStart.OFF)
        return (
            f'{{"id":"{ereq.request_id}","object":"chat.completion","created":{int(time.time())},'
            f'"model":{json.dumps(self.served.model.name)},"choices":[{choice}],'
            f'"usage":{json.dumps(body)}{extra}{weight_version_json(out.weight_version)}}}'
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
        head = (
            f'{{"id":"{ereq.request_id}","object":"chat.completion.chunk",'
            f'"created":{int(time.time())},"model":{json.dumps(self.served.model.name)},'
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tail = ',"usage":null}' if include_usage else "}"
        think = ereq.think
        [slot] = handle.choices

        def chunk(delta: dict[str, Any], logprobs: str, finish: str | None, extra: str = "") -> str:
            d = json.dumps(delta, ensure_ascii=False)
            fin = json.dumps(finish)
            choice = f'{{"index":0,"delta":{d},"logprobs":{logprobs},"finish_reason":{fin}{extra}}}'
            return f'data: {head}"choices":[{choice}]{tail}\n\n'

        ids = req.return_token_ids
        numbering = tools.CallIds(ereq.tools.parser if ereq.tools else None)
        try:
            first = f',"prompt_token_ids":{json.dumps(ereq.prompt_ids)}' if ids else ""
            out = await slot.get()  # the role chunk names the weights: it waits for them
            tail = weight_version_json(out.weight_version) + tail
            yield chunk({"role": "assistant", "content": ""}, "null", None, first)
            while True:
                if out.text or out.reasoning_text or out.num_tokens or out.tool_calls:
                    lp = self._logprobs_json(req, out, ereq)
                    extra = f',"token_ids":{json.dumps(out.token_ids.tolist())}' if ids else ""
                    calls = numbering.delta(out.tool_calls)
                    yield chunk(sections.delta(out, think, calls), lp, None, extra)
                if out.finished:
                    break
                out = await slot.get()
            if out.error:
                err = error_body(out.error, "server_error", None, None)
                yield f"data: {json.dumps(err)}\n\n"
            else:
                reason = out.finish_reason.value if out.finish_reason else None
                yield chunk({}, "null", tools.finish_reason(reason, numbering.count > 0))
            if include_usage:
                body = json.dumps(usage([out], think is not ThinkStart.OFF))
                w = weight_version_json(out.weight_version)
                yield f'data: {head}"choices":[],"usage":{body}{w}}}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            handle.abort()
