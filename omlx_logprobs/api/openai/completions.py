"""Legacy `/v1/completions`: a request prepared (api/core/prepare.py: prompts as text or token
ids, n choices per prompt from one prefill), and its JSON and SSE bodies: echo, the legacy
logprobs shape and vLLM's scoring extensions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from omlx_logprobs.api.core import sse
from omlx_logprobs.api.core.prepare import Ask, Prepared, prepare
from omlx_logprobs.api.core.protocol import CompletionRequest
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
from omlx_logprobs.logprobs.legacy import LegacyCursor
from omlx_logprobs.types import RequestOutput


@dataclass
class Choice:
    """One returned choice: which request and choice of it, and what its JSON needs besides
    the outputs."""

    index: int  # in the response: prompt * n + choice
    prompt_ids: list[int]
    echo_text: str  # the prompt's text when echo is on, else ""
    cursor: LegacyCursor  # character offset of the next legacy logprobs position
    started: bool = False  # whether the first (echo-carrying) chunk went out


class CompletionRun:
    """One completions request: prepared (everything checked first) and submitted at once (a
    bad request raises here, before any byte of a stream), then awaited whole or streamed;
    choice index = prompt * n + choice."""

    def __init__(self, req: CompletionRequest, served: Served) -> None:
        self.req, self.served = req, served
        self.p = p = prepare(Ask.completion(req), served)
        legacy = p.writer.legacy_fmt
        self.choices = [
            Choice(i * req.n + j, r.prompt_ids,
                   legacy.prompt_text(r.prompt_ids) if req.echo else "", LegacyCursor())
            for i, r in enumerate(p.requests)
            for j in range(req.n)
        ]  # fmt: skip
        self.handles = p.submit(served)

    @staticmethod
    def _logprobs(req: CompletionRequest, p: Prepared, c: Choice, out: RequestOutput) -> str:
        """The legacy logprobs of out's positions (after the echoed prompt's, in the choice's
        first output); the character offsets go on from the choice's cursor."""
        if out.logprobs is None:
            return "null"
        fixed = bool(req.logprob_token_ids)
        k = out.logprobs.k if fixed else (req.logprobs or 0)
        prompt = None
        if req.echo and not c.started:
            assert out.prompt_logprobs is not None
            prompt = (c.prompt_ids, out.prompt_logprobs)
        return p.writer.legacy(c.cursor, k, prompt, out.logprobs, fixed)

    @staticmethod
    def _extras(req: CompletionRequest, p: Prepared, c: Choice, out: RequestOutput) -> str:
        """vLLM's per-choice fields: prompt_logprobs, prompt_token_ids and token_ids."""
        extra = ""
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            extra += prompt_logprobs_fields(req, out.prompt_logprobs, p.writer)
        if req.return_token_ids:
            if not c.started:
                extra += f',"prompt_token_ids":{json.dumps(c.prompt_ids)}'
            extra += f',"token_ids":{json.dumps(out.token_ids.tolist())}'
        return extra

    def _head(self) -> str:
        p = self.p
        return head(p.request_id, "text_completion", p.model, self.served.fingerprint)

    async def complete(self, raw: Request) -> str:
        req, p = self.req, self.p
        outs = await finished(self.handles, raw)
        parts = []
        for c, out in zip(self.choices, outs):
            text = json.dumps(c.echo_text + out.text, ensure_ascii=False)
            lp = self._logprobs(req, p, c, out)
            extras = self._extras(req, p, c, out)
            finish = json.dumps(out.finish_reason.value if out.finish_reason else None)
            parts.append(
                f'{{"index":{c.index},"text":{text},"logprobs":{lp},'
                f'"finish_reason":{finish}{extras}{weight_spans_json(out)}'
                f"{routed_experts_json(out)}}}"
            )
        w = weight_version_json(outs[0].weight_version, outs[0].adapter)
        body = f'"choices":[{",".join(parts)}],"usage":{json.dumps(usage(outs))}{w}}}'
        return self._head() + body

    async def events(self) -> AsyncIterator[str]:
        req, p, choices = self.req, self.p, self.choices
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = sse.Chunks(self._head(), include_usage)
        finals: dict[int, RequestOutput] = {}
        async for at, out in sse.outputs(self.handles):
            chunks.name_weights(out)
            i = at * req.n + out.index
            c = choices[i]
            if out.error:
                finals[i] = out
                yield chunks.error(out.error)
                continue
            if out.text or out.num_tokens or not c.started:
                text = json.dumps(
                    (c.echo_text if not c.started else "") + out.text, ensure_ascii=False
                )
                lp = self._logprobs(req, p, c, out)
                extras = self._extras(req, p, c, out)
                c.started = True
                yield chunks.chunk(
                    f'{{"index":{i},"text":{text},"logprobs":{lp},"finish_reason":null{extras}}}'
                )
            if out.finished:
                finals[i] = out
                fin = json.dumps(out.finish_reason.value if out.finish_reason else None)
                end = (
                    f'{{"index":{i},"text":"","logprobs":null,"finish_reason":{fin}'
                    f"{weight_spans_json(out)}{routed_experts_json(out)}}}"
                )
                yield chunks.chunk(end)
        if include_usage:
            yield chunks.usage(usage([finals[c.index] for c in choices]))
        yield sse.DONE
