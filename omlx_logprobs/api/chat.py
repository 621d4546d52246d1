"""`/v1/chat/completions`: a chat request as one `EngineRequest` (the chat template's prompt,
its tool calls and reasoning parsed), and its JSON and SSE bodies: the message or the deltas,
the logprobs of each section, tool calls with their ids."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import Request

from omlx_logprobs.api import sections, tools
from omlx_logprobs.api.constraints import constraint_field
from omlx_logprobs.api.errors import APIError, error_body
from omlx_logprobs.api.inputs import chat_prompt, sampling_params
from omlx_logprobs.api.protocol import ChatCompletionRequest, ChatTokensRequest, NamedToolChoice
from omlx_logprobs.api.response import (
    prompt_logprobs_json,
    raise_if_failed,
    usage,
    wait_or_disconnect,
    weight_spans_json,
    weight_version_json,
)
from omlx_logprobs.api.served import Served
from omlx_logprobs.logprobs.columnar import encode_block
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.parsing.thinking import think_start
from omlx_logprobs.transport.client import RequestHandle, merged
from omlx_logprobs.types import EngineRequest, Entries, RequestOutput, ThinkStart


def reply_role(req: ChatCompletionRequest) -> str:
    """The role of the message generated (vLLM): a new assistant turn, or, without a
    generation prompt, more of the last message."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echo_text(req: ChatCompletionRequest) -> str:
    """Chat `echo` (vLLM): the last message's text, when it is of the reply's role."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == reply_role(req) else ""


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
        prompt = self.prompt(req)
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
        # tool_choice required or named, or a constraint beside tools: the calls' grammar
        constraint = tools.tool_constraint(req, parsing, served.model.tokenizer, params.constraint)
        if constraint is not params.constraint:
            params = replace(params, constraint=constraint)
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

    def prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The chat template's ids of the messages, or, on /v1/chat/completions/tokens, the
        ids the client sent (the conversation as its trainer holds it: never re-tokenized)."""
        served = self.served
        if not isinstance(req, ChatTokensRequest):
            return chat_prompt(req, served.model, served.checks)
        served.checks.check_token_ids(req.tokens, "tokens")
        return served.checks.truncated(list(req.tokens), req.truncate_prompt_tokens)

    def flat(self, req: ChatCompletionRequest) -> bool:
        """Whether every generated token's entry goes in logprobs.content (docs/specs/rl.md:
        a client that asks for the token ids aligns them with these entries)."""
        if req.flat_logprobs is not None:
            return req.flat_logprobs
        return req.return_token_ids or self.served.cfg.flat_logprobs

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
                f'"finish_reason":{finish}{ids}{weight_spans_json(out)}}}'
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
        w = weight_version_json(outs[0].weight_version, outs[0].adapter)
        return (
            f'{self._head(ereq, "chat.completion")}"choices":[{",".join(choices)}],'
            f'"usage":{json.dumps(body)}{extra}{w}}}'
        )

    def _logprobs_json(
        self, req: ChatCompletionRequest, out: RequestOutput, ereq: EngineRequest
    ) -> str:
        """The entries of out's tokens; with the thinking parser on, reasoning tokens apart
        (reasoning comes first); with tool calls parsed, the calls' tokens apart (they come
        last); flat (`flat`), all of them in content, in order."""
        e = out.logprobs
        if e is None:
            return "null"
        head = "{"
        entries: Callable[[Entries], str] = self.formatters[req.return_tokens_as_token_ids].entries
        if (encoding := req.logprobs_format) != "openai":
            head = f'{{"format":"{encoding}",'

            def entries(rows: Entries) -> str:
                return encode_block(rows, e.k, encoding)

        if (ereq.think is ThinkStart.OFF and ereq.tools is None) or self.flat(req):
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
            tail = weight_version_json(head_out.weight_version, head_out.adapter) + tail
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
                    yield chunk(i, {}, "null", finish, weight_spans_json(out))
            if include_usage:
                done = [finals[i] for i in sorted(finals)]
                body = json.dumps(usage(done, think is not ThinkStart.OFF))
                w = weight_version_json(done[0].weight_version, done[0].adapter)
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
