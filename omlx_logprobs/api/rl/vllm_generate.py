"""vLLM's tokens-in, tokens-out route, `POST /inference/v1/generate` (verifiers v1, prime-rl,
SkyRL): prompt ids and vLLM's `sampling_params` in; per choice the sampled ids, their entries
in `logprobs.content` (every token, in order, `token_id:<id>` strings) and the finish reason
out. No chat template, no text: the client renders and parses."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from omlx_logprobs.api.core.errors import APIError, error_body
from omlx_logprobs.api.core.prepare import Ask, sampling_params
from omlx_logprobs.api.core.response import (
    prompt_logprobs_fields,
    raise_if_failed,
    usage,
    wait_or_disconnect,
    weight_spans_json,
    weight_version_json,
)
from omlx_logprobs.api.core.routed_experts import routed_experts_json, with_routing
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.rl.features import images_of
from omlx_logprobs.api.rl.protocol import GenerateRequest
from omlx_logprobs.transport.client import merged
from omlx_logprobs.types import EngineRequest, RequestOutput, cache_namespace


def engine_request(req: GenerateRequest, served: Served) -> tuple[str, EngineRequest]:
    """Validate; the response's request_id (vLLM's: the caller's id, or a new one, after
    `generate-tokens-`) and the engine's request."""
    sp = req.sampling_params
    name = req.model or served.model.name
    served.check_model(name)
    served.checks.check(req)
    constraint = served.checks.check(sp)
    served.checks.check_token_ids(req.token_ids, "token_ids")
    if req.features is not None and sp.truncate_prompt_tokens is not None:
        raise APIError(
            "truncate_prompt_tokens cannot cut a prompt with images",
            param="sampling_params.truncate_prompt_tokens",
        )
    ids = served.checks.truncated(list(req.token_ids), sp.truncate_prompt_tokens)
    images = images_of(req.features, ids, served)
    ask = Ask(sp, sp.max_tokens, sp.logprobs is not None, sp.logprobs or 0,
              sp.prompt_logprobs, prompt_param="token_ids")  # fmt: skip
    params = sampling_params(ask, served, len(ids), constraint)
    params, replay = with_routing(req, served, len(ids), params)
    rid = f"generate-tokens-{req.request_id or uuid.uuid4().hex}"
    # the engine's id is unique among requests in flight whatever the caller sent
    ereq = EngineRequest(
        f"{rid}-{uuid.uuid4().hex[:8]}", ids, params, sp.n, stream=req.stream,
        adapter=served.adapter(name), cache_namespace=cache_namespace(req.cache_salt),
        priority=req.priority, routed_experts=replay, images=images,
    )  # fmt: skip
    return rid, ereq


class GenerateRun:
    """One generate request: checked and submitted at once (a bad request raises here, before
    any byte of a stream), then awaited whole or streamed."""

    def __init__(self, req: GenerateRequest, served: Served) -> None:
        self.req, self.served = req, served
        # the served vocabulary's formatters, made once (vLLM writes `token_id:<id>`)
        self.entries = served.writers.choose("openai", True).chat
        self.writer = served.writers.choose("openai", False)
        self.rid, self.ereq = engine_request(req, served)
        self.handle = served.engine.submit(self.ereq)

    def _choice(self, out: RequestOutput, finish: bool) -> str:
        lp = (
            "null"
            if out.logprobs is None
            else f'{{"content":{self.entries.entries(out.logprobs)}}}'
        )
        reason = out.finish_reason.value if finish and out.finish_reason else None
        spans = weight_spans_json(out) + routed_experts_json(out) if finish else ""
        return (
            f'{{"index":{out.index},"logprobs":{lp},"finish_reason":{json.dumps(reason)},'
            f'"token_ids":{json.dumps(out.token_ids.tolist())}{spans}}}'
        )

    def _head(self) -> str:
        model = json.dumps(self.served.adapter(self.req.model or "") or self.served.model.name)
        return f'{{"request_id":{json.dumps(self.rid)},"model":{model},'

    async def complete(self, raw: Request) -> str:
        ereq, handle = self.ereq, self.handle
        try:
            outs = await wait_or_disconnect([handle], raw)
        finally:
            handle.abort()
        raise_if_failed(outs)
        choices = ",".join(self._choice(out, True) for out in outs)
        scored = outs[0].prompt_logprobs
        prompt = ',"prompt_logprobs":null'
        if ereq.params.prompt_logprobs is not None and scored is not None:
            sp = self.req.sampling_params
            prompt = prompt_logprobs_fields(sp, scored, self.writer, images=ereq.images)
        return (
            f'{self._head()}"choices":[{choices}]{prompt},'
            f'"kv_transfer_params":null,"usage":{json.dumps(usage(outs))}'
            f"{weight_version_json(outs[0].weight_version, outs[0].adapter)}}}"
        )

    async def events(self) -> AsyncIterator[str]:
        req, handle, head = self.req, self.handle, self._head()
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
