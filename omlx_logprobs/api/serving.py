"""From a validated request to engine work and back: prompt building, parameter checks, and the
JSON and SSE bodies of chat completions."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fastapi import Request

from omlx_logprobs.api import sections
from omlx_logprobs.api.errors import APIError, error_body
from omlx_logprobs.api.limits import RequestLimits, model_bounds
from omlx_logprobs.api.protocol import ChatCompletionRequest, SamplingFields
from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.engine.engine import EngineClient, RequestHandle
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.logprobs.format import ChatLogprobFormatter, EntriesText
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.parsing.thinking import ThinkStart, think_start
from omlx_logprobs.types import (
    MAX_LOGPROB_TOKEN_IDS,
    LogprobsMode,
    RequestOutput,
    SamplingParams,
)


@dataclass(frozen=True)
class Served:
    """Everything a route needs: the engine, the model's facts and the server's limits."""

    engine: EngineClient
    model: LoadedModel
    cfg: EngineConfig
    reasoning: bool = False  # the thinking parser is on (--reasoning-parser)
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
    """Request fields as SamplingParams; a 400 for every value the engine cannot take (the size
    and range checks live in api/limits.py). `prompt_logprobs` is what the engine computes (the
    caller may ask more than the field)."""
    completion = getattr(req, "max_completion_tokens", None) is not None
    tokens_param = "max_completion_tokens" if completion else "max_tokens"
    prompt_param = "messages" if hasattr(req, "messages") else "prompt"
    room = served.checks.check_prompt(prompt_len, max_tokens, prompt_param, tokens_param)
    cap = served.cfg.max_top_logprobs
    if prompt_logprobs is not None and prompt_logprobs > cap:
        raise APIError(f"prompt_logprobs must be at most {cap}", param="prompt_logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    vocab = len(served.model.vocab)
    bias = _logit_bias(req.logit_bias or {}, vocab)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else room,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=min(max(req.top_k, 0), vocab),
        min_p=req.min_p,
        seed=req.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logit_bias=bias,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        logprob_token_ids=_logprob_token_ids(req, vocab, logprobs or prompt_logprobs is not None),
        logprobs_mode=LogprobsMode(req.logprobs_mode or served.cfg.logprobs_mode),
    )


def _logprob_token_ids(req: SamplingFields, vocab: int, any_logprobs: bool) -> tuple[int, ...]:
    ids = req.logprob_token_ids
    if ids is None:
        return ()
    param = "logprob_token_ids"
    if not any_logprobs:
        raise APIError("logprob_token_ids needs logprobs or prompt_logprobs", param=param)
    if not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS:
        raise APIError(f"logprob_token_ids takes 1 to {MAX_LOGPROB_TOKEN_IDS} ids", param=param)
    for t in ids:
        if not 0 <= t < vocab:
            raise APIError(f"logprob_token_ids: {t} is not a token id of this model", param=param)
    if len(set(ids)) != len(ids):
        raise APIError("logprob_token_ids must be distinct", param=param)
    return tuple(ids)


def _logit_bias(raw: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(
                f"logit_bias: key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= tid < vocab:
            raise APIError(f"logit_bias: {tid} is not a token id of this model", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError("logit_bias values must be in [-100, 100]", param="logit_bias")
        out.append((tid, float(value)))
    return tuple(out)


def chat_prompt(
    req: ChatCompletionRequest, model: LoadedModel, checks: RequestLimits | None = None
) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(req.chat_template_kwargs or {})
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


async def wait_or_disconnect(handle: RequestHandle, raw: Request) -> RequestOutput:
    """Collect every output until the request finishes; abort it if the client goes away."""
    return (await wait_all_or_disconnect([handle], raw))[0]


async def wait_all_or_disconnect(handles: list[RequestHandle], raw: Request) -> list[RequestOutput]:
    """Each request's merged outputs once all have finished; ConnectionAbortedError if the
    client goes away first (the caller aborts what is unfinished)."""

    async def collect(handle: RequestHandle) -> RequestOutput:
        out = await handle.collector.get()
        while not out.finished:
            out = out.merge(await handle.collector.get())
        return out

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    async def collect_all() -> list[RequestOutput]:
        return list(await asyncio.gather(*[collect(h) for h in handles]))

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


def check_prompt_logprobs(req: SamplingFields) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs is not available with streaming", param="prompt_logprobs")


class ChatServing:
    def __init__(self, served: Served) -> None:
        self.served = served
        vocab = served.model.vocab
        self.formatters = (ChatLogprobFormatter(vocab), ChatLogprobFormatter(vocab, as_ids=True))
        self.prompt_formatters = (
            PromptLogprobFormatter(vocab),
            PromptLogprobFormatter(vocab, as_ids=True),
        )

    def _start(self, req: ChatCompletionRequest) -> tuple[RequestHandle, EntriesText | None]:
        """Submit the request: its handle, and for a non-streamed one with top lists the text
        of its entries, which grows while it runs (see EntriesText)."""
        served = self.served
        served.check_model(req.model)
        served.checks.check(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.n != 1:
            raise APIError("Only n=1 is supported on chat completions.", param="n")
        check_prompt_logprobs(req)
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
        think = think_start(served.reasoning, served.model.tokenizer.decode(prompt[-8:]))
        seq = Sequence(f"chatcmpl-{uuid.uuid4().hex}", prompt, params, think)
        text = None
        if not req.stream and seq.store is not None and seq.store.k and think is ThinkStart.OFF:
            text = EntriesText(self.formatters[req.return_tokens_as_token_ids], seq.store)
        loop = asyncio.get_running_loop()
        progress = text.extend if text is not None else None
        return served.engine.add_request(seq, loop, not req.stream, progress), text

    async def complete(self, req: ChatCompletionRequest, raw: Request) -> dict[str, Any] | str:
        handle, text = self._start(req)
        try:
            out = await wait_or_disconnect(handle, raw)
        finally:
            if handle.seq.finish_reason is None:
                self.served.engine.abort(handle.seq)
        _raise_if_failed(out)
        seq = handle.seq
        lp = self._logprobs_json(req, seq, out, text)
        message = json.dumps(
            {"role": "assistant", **sections.message(out, seq.think)}, ensure_ascii=False
        )
        finish = json.dumps(out.finish_reason.value if out.finish_reason else None)
        ids = ""
        if req.return_token_ids:
            ids = f',"token_ids":{json.dumps(seq.output_ids[: out.end_token].tolist())}'
        choice = f'{{"index":0,"message":{message},"logprobs":{lp},"finish_reason":{finish}{ids}}}'
        prompt_ids = ""
        if req.return_token_ids:
            prompt_ids = f',"prompt_token_ids":{json.dumps(seq.prompt_ids)}'
        if req.prompt_logprobs is not None and seq.prompt_store is not None:
            fmt = self.prompt_formatters[req.return_tokens_as_token_ids]
            entries = fmt.json(seq.prompt_store, req.prompt_logprobs, bool(req.logprob_token_ids))
            prompt_ids += f',"prompt_logprobs":{entries}'
        return (
            f'{{"id":"{seq.request_id}","object":"chat.completion","created":{int(time.time())},'
            f'"model":{json.dumps(self.served.model.name)},"choices":[{choice}],'
            f'"usage":{json.dumps(_usage(out, seq.think))}{prompt_ids}}}'
        )

    def _logprobs_json(
        self,
        req: ChatCompletionRequest,
        seq: Sequence,
        out: RequestOutput,
        text: EntriesText | None = None,
    ) -> str:
        """The entries of out's tokens; with the thinking parser on, reasoning tokens apart."""
        if seq.store is None:
            return "null"
        entries = self.formatters[req.return_tokens_as_token_ids].entries
        first, split, end = out.first_token, out.split_token, out.end_token
        if seq.think is ThinkStart.OFF:
            body = text.json(first, end) if text is not None else entries(seq.store, first, end)
            return '{"content":' + body + ',"refusal":null}'
        return (
            f'{{"content":{entries(seq.store, split, end)},'
            f'"reasoning_content":{entries(seq.store, first, split)},"refusal":null}}'
        )

    def stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        handle, _ = self._start(req)  # errors raise here, before the 200 starts
        return self._events(req, handle)

    async def _events(
        self, req: ChatCompletionRequest, handle: RequestHandle
    ) -> AsyncIterator[str]:
        seq = handle.seq
        head = (
            f'{{"id":"{seq.request_id}","object":"chat.completion.chunk","created":{int(time.time())},'
            f'"model":{json.dumps(self.served.model.name)},'
        )
        usage = bool(req.stream_options and req.stream_options.include_usage)
        tail = ',"usage":null}' if usage else "}"

        def chunk(delta: dict[str, Any], logprobs: str, finish: str | None, extra: str = "") -> str:
            d = json.dumps(delta, ensure_ascii=False)
            fin = json.dumps(finish)
            choice = f'{{"index":0,"delta":{d},"logprobs":{logprobs},"finish_reason":{fin}{extra}}}'
            return f'data: {head}"choices":[{choice}]{tail}\n\n'

        ids = req.return_token_ids
        try:
            first = f',"prompt_token_ids":{json.dumps(seq.prompt_ids)}' if ids else ""
            yield chunk({"role": "assistant", "content": ""}, "null", None, first)
            while True:
                out = await handle.collector.get()
                if out.text or out.reasoning_text or out.end_token > out.first_token:
                    lp = self._logprobs_json(req, seq, out)
                    new = seq.output_ids[out.first_token : out.end_token].tolist() if ids else []
                    extra = f',"token_ids":{json.dumps(new)}' if ids else ""
                    yield chunk(sections.delta(out, seq.think), lp, None, extra)
                if out.finished:
                    break
            if out.error:
                err = error_body(out.error, "server_error", None, None)
                yield f"data: {json.dumps(err)}\n\n"
            else:
                yield chunk({}, "null", out.finish_reason.value if out.finish_reason else None)
            if usage:
                yield f'data: {head}"choices":[],"usage":{json.dumps(_usage(out, seq.think))}}}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            if seq.finish_reason is None:
                self.served.engine.abort(seq)


def _usage(out: RequestOutput, think: ThinkStart = ThinkStart.OFF) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }
    if think is not ThinkStart.OFF:  # the final output's content_start counts reasoning tokens
        usage["completion_tokens_details"] = {"reasoning_tokens": out.content_start}
    return usage


def _raise_if_failed(out: RequestOutput) -> None:
    if out.error:
        raise APIError(out.error, status=500, type_="server_error")
