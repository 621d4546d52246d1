"""`/v1/chat/completions`: a chat request prepared (api/core/prepare.py), and its JSON and SSE
bodies: the message or the deltas, the logprobs of each section, tool calls with their ids."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from omlx_logprobs.api.core import sections, sse, tools
from omlx_logprobs.api.core.prepare import Ask, Prepared, prepared
from omlx_logprobs.api.core.protocol import ChatCompletionRequest, NamedToolChoice
from omlx_logprobs.api.core.response import (
    finished,
    head,
    prompt_logprobs_fields,
    usage,
    weight_spans_json,
    weight_version_json,
)
from omlx_logprobs.api.core.routed_experts import routed_experts_json
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.types import RequestOutput, ThinkStart


def reply_role(req: ChatCompletionRequest) -> str:
    """The role of the message generated (vLLM): a new assistant turn, or, without a
    generation prompt, more of the last message."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echo_text(req: ChatCompletionRequest) -> str:
    """Chat `echo` (vLLM): the last message's text, when it is of the reply's role."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == reply_role(req) else ""


def logprobs_json(p: Prepared, out: RequestOutput, flat: bool = False) -> str:
    """The entries of out's tokens; with the thinking parser on, reasoning tokens apart
    (reasoning comes first); with tool calls parsed, the calls' tokens apart (they come
    last); `flat`, all of them in content, in order."""
    split = sections.sections(out)
    if split is None:
        return "null"
    ereq, w = p.first, p.writer
    if (ereq.think is ThinkStart.OFF and ereq.tools is None) or flat:
        return f'{w.head}"content":{w.entries(out.logprobs)},"refusal":null}}'
    body = f'{w.head}"content":{w.entries(split.content)},'
    if ereq.think is not ThinkStart.OFF:
        body += f'"reasoning_content":{w.entries(split.reasoning)},'
    if ereq.tools is not None:
        body += f'"tool_calls":{w.entries(split.tools)},'
    return body + '"refusal":null}'


class ChatRun:
    """One chat completion: prepared and submitted at once (a bad request raises here, before
    any byte of a stream), then awaited whole or streamed."""

    def __init__(self, req: ChatCompletionRequest, served: Served, p: Prepared) -> None:
        self.req, self.served, self.p = req, served, p
        self.handle = p.submit(served)[0]

    @classmethod
    async def start(cls, req: ChatCompletionRequest, served: Served) -> ChatRun:
        """Prepared (off the event loop when it has images) and submitted."""
        return cls(req, served, await prepared(Ask.chat(req), served))

    def flat(self) -> bool:
        """Whether every generated token's entry goes in logprobs.content (docs/specs/rl.md:
        a client that asks for the token ids aligns them with these entries)."""
        req = self.req
        if req.flat_logprobs is not None:
            return req.flat_logprobs
        return req.return_token_ids or self.served.cfg.flat_logprobs

    def _prompt_logprobs(self, out: RequestOutput) -> str:
        """vLLM's `prompt_logprobs` field of the response (streamed: of its first chunk), from
        a choice's first output (which carries the prompt's entries); "" when not asked."""
        scored, asked = out.prompt_logprobs, self.p.first.params.prompt_logprobs
        if asked is None or scored is None:
            return ""
        images = self.p.first.images
        return prompt_logprobs_fields(self.req, scored, self.p.writer, asked, images)

    def _head(self, kind: str) -> str:
        return head(self.p.request_id, kind, self.p.model, self.served.fingerprint)

    async def complete(self, raw: Request) -> str:
        req, p = self.req, self.p
        ereq = p.first
        outs = await finished([self.handle], raw)
        for out in outs:
            p.heard(out)
        role, echo = reply_role(req), echo_text(req)
        parser = ereq.tools.parser if ereq.tools else None
        named = isinstance(req.tool_choice, NamedToolChoice)
        flat = self.flat()
        choices = []
        for out in outs:
            calls = tools.CallIds(parser).message(out.tool_calls)
            body = sections.message(out, ereq.think, calls)
            if echo:
                body["content"] = echo + (body.get("content") or "")
            message = json.dumps({"role": role, **body}, ensure_ascii=False)
            reason = out.finish_reason.value if out.finish_reason else None
            finish = json.dumps(tools.finish_reason(reason, bool(calls), named))
            ids = ""
            if req.return_token_ids:
                ids = f',"token_ids":{json.dumps(out.token_ids.tolist())}'
            choices.append(
                f'{{"index":{out.index},"message":{message},'
                f'"logprobs":{logprobs_json(p, out, flat)},'
                f'"finish_reason":{finish}{ids}{weight_spans_json(out)}'
                f"{routed_experts_json(out)}}}"
            )
        extra = ""
        if req.return_token_ids:
            extra = f',"prompt_token_ids":{json.dumps(ereq.prompt_ids)}'
        extra += self._prompt_logprobs(outs[0])
        body = usage(outs, ereq.think is not ThinkStart.OFF, p.reused)
        return (
            f'{self._head("chat.completion")}"choices":[{",".join(choices)}],'
            f'"usage":{json.dumps(body)}{extra}'
            f"{weight_version_json(outs[0].weight_version, outs[0].adapter)}}}"
        )

    async def events(self) -> AsyncIterator[str]:
        req, p = self.req, self.p
        ereq = p.first
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = sse.Chunks(self._head("chat.completion.chunk"), include_usage)

        def choice(
            i: int,
            delta: dict[str, Any],
            logprobs: str,
            finish: str | None,
            extra: str = "",
            top: str = "",
        ) -> str:
            d, fin = json.dumps(delta, ensure_ascii=False), json.dumps(finish)
            return chunks.chunk(
                f'{{"index":{i},"delta":{d},"logprobs":{logprobs},"finish_reason":{fin}{extra}}}',
                top,
            )

        ids = req.return_token_ids
        role, echo = reply_role(req), echo_text(req)
        finals: dict[int, RequestOutput] = {}
        parser = ereq.tools.parser if ereq.tools else None
        numbering = [tools.CallIds(parser) for _ in range(ereq.n)]  # call ids per choice
        named = isinstance(req.tool_choice, NamedToolChoice)
        flat = self.flat()
        started = False
        async for _, out in sse.outputs([self.handle]):
            p.heard(out)
            if not started:  # the role chunks name the weights: they wait for the first output
                started = True
                chunks.name_weights(out)
                first = f',"prompt_token_ids":{json.dumps(ereq.prompt_ids)}' if ids else ""
                scored = self._prompt_logprobs(out)
                for i in range(ereq.n):  # prompt ids and entries once, in the first chunk
                    yield choice(
                        i, {"role": role, "content": ""}, "null", None,
                        first * (i == 0), scored * (i == 0),
                    )  # fmt: skip
                if echo:  # vLLM: the echoed text in a chunk of its own, before the generated
                    for i in range(ereq.n):
                        yield choice(i, {"content": echo}, "null", None)
            i = out.index
            if out.error:
                finals[i] = out
                yield chunks.error(out.error)
                continue
            if out.text or out.reasoning_text or out.num_tokens or out.tool_calls:
                extra = f',"token_ids":{json.dumps(out.token_ids.tolist())}' if ids else ""
                delta = sections.delta(out, ereq.think, numbering[i].delta(out.tool_calls))
                yield choice(i, delta, logprobs_json(p, out, flat), None, extra)
            if out.finished:
                finals[i] = out
                reason = out.finish_reason.value if out.finish_reason else None
                called = numbering[i].count > 0
                finish = tools.finish_reason(reason, called, named)
                yield choice(
                    i, {}, "null", finish, weight_spans_json(out) + routed_experts_json(out)
                )
        if include_usage:
            done = [finals[i] for i in sorted(finals)]
            yield chunks.usage(usage(done, ereq.think is not ThinkStart.OFF, p.reused))
        yield sse.DONE
