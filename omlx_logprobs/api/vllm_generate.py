"""vLLM's tokens-in, tokens-out route, `POST /inference/v1/generate` (verifiers v1, prime-rl,
SkyRL): prompt ids and vLLM's `sampling_params` in; per choice the sampled ids, their entries
in `logprobs.content` (every token, in order, `token_id:<id>` strings) and the finish reason
out. No chat template, no text: the client renders and parses."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from omlx_logprobs.api.errors import error_body
from omlx_logprobs.api.prepare import Ask, sampling_params
from omlx_logprobs.api.protocol import GenerateRequest
from omlx_logprobs.api.response import (
    raise_if_failed,
    usage,
    wait_or_disconnect,
    weight_spans_json,
    weight_version_json,
)
from omlx_logprobs.api.served import Served
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.transport.client import RequestHandle, merged
from omlx_logprobs.types import EngineRequest, RequestOutput


class GenerateServing:
    def __init__(self, served: Served) -> None:
        self.served = served
        vocab = served.model.vocab
        self.entries = ChatLogprobFormatter(vocab, as_ids=True)  # vLLM writes `token_id:<id>`
        self.prompt_fmt = PromptLogprobFormatter(vocab)

    def _start(self, req: GenerateRequest) -> tuple[str, EngineRequest, RequestHandle]:
        """Validate, then submit; the response's request_id (vLLM's: the caller's id, or a
        new one, after `generate-tokens-`) and the engine's request."""
        served, sp = self.served, req.sampling_params
        name = req.model or served.model.name
        served.check_model(name)
        served.checks.check(req)
        constraint = served.checks.check(sp)
        served.checks.check_token_ids(req.token_ids, "token_ids")
        ids = served.checks.truncated(list(req.token_ids), sp.truncate_prompt_tokens)
        ask = Ask(sp, sp.max_tokens, sp.logprobs is not None, sp.logprobs or 0,
                  sp.prompt_logprobs, prompt_param="token_ids")  # fmt: skip
        params = sampling_params(ask, served, len(ids), constraint)
        rid = f"generate-tokens-{req.request_id or uuid.uuid4().hex}"
        # the engine's id is unique among requests in flight whatever the caller sent
        ereq = EngineRequest(
            f"{rid}-{uuid.uuid4().hex[:8]}", ids, params, sp.n, stream=req.stream,
            adapter=served.adapter(name),
        )  # fmt: skip
        return rid, ereq, served.engine.submit(ereq)

    def _choice(self, out: RequestOutput, finish: bool) -> str:
        lp = (
            "null"
            if out.logprobs is None
            else f'{{"content":{self.entries.entries(out.logprobs)}}}'
        )
        reason = out.finish_reason.value if finish and out.finish_reason else None
        spans = weight_spans_json(out) if finish else ""
        return (
            f'{{"index":{out.index},"logprobs":{lp},"finish_reason":{json.dumps(reason)},'
            f'"token_ids":{json.dumps(out.token_ids.tolist())}{spans}}}'
        )

    def _head(self, rid: str, name: str | None) -> str:
        model = json.dumps(self.served.adapter(name or "") or self.served.model.name)
        return f'{{"request_id":{json.dumps(rid)},"model":{model},'

    async def complete(self, req: GenerateRequest, raw: Request) -> str:
        rid, ereq, handle = self._start(req)
        try:
            outs = await wait_or_disconnect([handle], raw)
        finally:
            handle.abort()
        raise_if_failed(outs)
        choices = ",".join(self._choice(out, True) for out in outs)
        scored = outs[0].prompt_logprobs
        prompt = "null"
        if ereq.params.prompt_logprobs is not None and scored is not None:
            fixed = bool(ereq.params.logprob_token_ids)
            prompt = self.prompt_fmt.json(scored, ereq.params.prompt_logprobs, fixed)
        return (
            f'{self._head(rid, req.model)}"choices":[{choices}],"prompt_logprobs":{prompt},'
            f'"kv_transfer_params":null,"usage":{json.dumps(usage(outs))}'
            f"{weight_version_json(outs[0].weight_version, outs[0].adapter)}}}"
        )

    def stream(self, req: GenerateRequest) -> AsyncIterator[str]:
        rid, ereq, handle = self._start(req)  # errors raise here, before the 200 starts
        return self._events(req, rid, handle)

    async def _events(
        self, req: GenerateRequest, rid: str, handle: RequestHandle
    ) -> AsyncIterator[str]:
        head = self._head(rid, req.model)
        finals: dict[int, RequestOutput] = {}
        try:
            async for _, out in merged([handle]):
                w = weight_version_json(out.weight_version, out.adapter)
                if out.error:
                    finals[out.index] = out
                    err = error_body(out.error, "server_error", None, None)
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                if out.num_tokens or out.finished:
                    yield f'data: {head}"choices":[{self._choice(out, out.finished)}]{w}}}\n\n'
                if out.finished:
                    finals[out.index] = out
            if req.stream_options is not None and req.stream_options.include_usage:
                done = [finals[i] for i in sorted(finals)]
                yield f'data: {head}"choices":[],"usage":{json.dumps(usage(done))}}}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            handle.abort()
