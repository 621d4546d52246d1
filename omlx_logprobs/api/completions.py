"""Legacy `/v1/completions`: prompts as text or token ids, n choices per prompt from one prefill,
echo, the legacy logprobs shape and vLLM's scoring extensions; JSON and SSE bodies."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from omlx_logprobs.api.errors import APIError, error_body
from omlx_logprobs.api.inputs import encode, sampling_params
from omlx_logprobs.api.protocol import CompletionRequest
from omlx_logprobs.api.response import (
    prompt_logprobs_json,
    raise_if_failed,
    usage,
    wait_or_disconnect,
    weight_spans_json,
    weight_version_json,
)
from omlx_logprobs.api.served import Served
from omlx_logprobs.logprobs.columnar import Encoding, encode_block
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.transport.client import RequestHandle, merged
from omlx_logprobs.types import EngineRequest, Entries, RequestOutput

MAX_PROMPTS = 256  # prompts in one request (lm-eval batches several)


@dataclass
class Choice:
    """One returned choice: which request and choice of it, and what its JSON needs besides
    the outputs."""

    index: int  # in the response: prompt * n + choice
    prompt_ids: list[int]
    echo_text: str  # the prompt's text when echo is on, else ""
    cursor: LegacyCursor  # character offset of the next legacy logprobs position
    started: bool = False  # whether the first (echo-carrying) chunk went out


def parse_prompts(req: CompletionRequest, served: Served) -> list[list[int]]:
    """Every accepted `prompt` form as a list of token id lists; a 400 for the rest."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"At most {MAX_PROMPTS} prompts are allowed.", param="prompt")
    vocab = len(served.model.vocab)
    out = []
    for i, x in enumerate(prompts):
        if isinstance(x, str):
            served.checks.check_text(x, "prompt")
            ids = encode(served.model, x, "prompt", special=req.add_special_tokens)
        else:
            ids = list(x)
        if not ids:
            raise APIError(f"prompt[{i}] has no tokens", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(f"prompt[{i}] holds an id that is not a token of this model", "prompt")
        out.append(served.checks.truncated(list(ids), req.truncate_prompt_tokens))
    return out


def columnar_json(
    encoding: Encoding, k: int, prompt: tuple[list[int], Entries] | None, generated: Entries
) -> str:
    """The compact form of a choice's legacy logprobs: the echoed prompt's positions after its
    first (whose token has no logprob) as one block, the generated tokens' as another."""
    echo = encode_block(prompt[1], k, encoding) if prompt is not None else "null"
    block = encode_block(generated, k, encoding)
    return f'{{"format":"{encoding}","prompt":{echo},"completion":{block}}}'


class CompletionServing:
    def __init__(self, served: Served) -> None:
        self.served = served
        vocab = served.model.vocab
        self.legacy = (LegacyLogprobFormatter(vocab), LegacyLogprobFormatter(vocab, as_ids=True))
        self.prompt_fmt = (PromptLogprobFormatter(vocab), PromptLogprobFormatter(vocab, True))

    def _start(self, req: CompletionRequest) -> tuple[str, list[RequestHandle], list[Choice]]:
        """Validate everything first, then submit one request per prompt (its n choices from
        one prefill); choice index = prompt * n + choice."""
        served = self.served
        served.check_model(req.model)
        served.checks.check_completion(req)
        cap = served.checks.bounds.max_top_logprobs
        if req.logprobs is not None and req.logprobs > cap:
            raise APIError(f"logprobs must be at most {cap}", param="logprobs")
        prompts = parse_prompts(req, served)
        # echo with logprobs needs the prompt's entries, with as many alternatives as logprobs
        wanted = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            wanted = max(wanted or 0, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        requests = []
        for i, ids in enumerate(prompts):
            params = sampling_params(
                req, served, len(ids), req.max_tokens, req.logprobs is not None,
                req.logprobs or 0, wanted,
            )  # fmt: skip
            requests.append(
                EngineRequest(
                    f"{rid}-{i}", ids, params, req.n, stream=req.stream,
                    adapter=served.adapter(req.model),
                )
            )  # fmt: skip
        legacy = self.legacy[0]
        choices = [
            Choice(i * req.n + j, r.prompt_ids,
                   legacy.prompt_text(r.prompt_ids) if req.echo else "", LegacyCursor())
            for i, r in enumerate(requests)
            for j in range(req.n)
        ]  # fmt: skip
        return rid, [served.engine.submit(r) for r in requests], choices

    def _logprobs(self, req: CompletionRequest, c: Choice, out: RequestOutput) -> str:
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
        if req.logprobs_format != "openai":
            return columnar_json(req.logprobs_format, k, prompt, out.logprobs)
        fmt = self.legacy[req.return_tokens_as_token_ids]
        return fmt.json(c.cursor, k, prompt, out.logprobs, fixed)

    def _extras(self, req: CompletionRequest, c: Choice, out: RequestOutput) -> str:
        """vLLM's per-choice fields: prompt_logprobs, prompt_token_ids and token_ids."""
        extra = ""
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            scored = prompt_logprobs_json(req, out.prompt_logprobs, self.prompt_fmt)
            extra += f',"prompt_logprobs":{scored}'
        if req.return_token_ids:
            if not c.started:
                extra += f',"prompt_token_ids":{json.dumps(c.prompt_ids)}'
            extra += f',"token_ids":{json.dumps(out.token_ids.tolist())}'
        return extra

    def _head(self, rid: str, model: str) -> str:
        return (
            f'{{"id":"{rid}","object":"text_completion","created":{int(time.time())},'
            f'"model":{json.dumps(self.served.adapter(model) or self.served.model.name)},'
            f'"system_fingerprint":"{self.served.fingerprint}",'
        )

    async def complete(self, req: CompletionRequest, raw: Request) -> str:
        rid, handles, choices = self._start(req)
        try:
            outs = await wait_or_disconnect(handles, raw)
        finally:
            for h in handles:
                h.abort()
        raise_if_failed(outs)
        parts = []
        for c, out in zip(choices, outs):
            text = json.dumps(c.echo_text + out.text, ensure_ascii=False)
            lp = self._logprobs(req, c, out)
            extras = self._extras(req, c, out)
            finish = json.dumps(out.finish_reason.value if out.finish_reason else None)
            parts.append(
                f'{{"index":{c.index},"text":{text},"logprobs":{lp},'
                f'"finish_reason":{finish}{extras}{weight_spans_json(out)}}}'
            )
        w = weight_version_json(outs[0].weight_version, outs[0].adapter)
        body = f'"choices":[{",".join(parts)}],"usage":{json.dumps(usage(outs))}{w}}}'
        return self._head(rid, req.model) + body

    def stream(self, req: CompletionRequest) -> AsyncIterator[str]:
        rid, handles, choices = self._start(req)  # errors raise here, before the 200 starts
        return self._events(req, rid, handles, choices)

    async def _events(
        self, req: CompletionRequest, rid: str, handles: list[RequestHandle], choices: list[Choice]
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tail = ',"usage":null}' if include_usage else "}"
        head = self._head(rid, req.model)
        finals: dict[int, RequestOutput] = {}
        w = ""
        try:
            async for p, out in merged(handles):
                if not w:  # one version for the response (see weight_version_json)
                    w = weight_version_json(out.weight_version, out.adapter)
                    tail = w + tail
                i = p * req.n + out.index
                c = choices[i]
                if out.error:
                    finals[i] = out
                    err = error_body(out.error, "server_error", None, None)
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                if out.text or out.num_tokens or not c.started:
                    text = json.dumps(
                        (c.echo_text if not c.started else "") + out.text, ensure_ascii=False
                    )
                    lp = self._logprobs(req, c, out)
                    extras = self._extras(req, c, out)
                    c.started = True
                    choice = (
                        f'{{"index":{i},"text":{text},"logprobs":{lp},'
                        f'"finish_reason":null{extras}}}'
                    )
                    yield f'data: {head}"choices":[{choice}]{tail}\n\n'
                if out.finished:
                    finals[i] = out
                    fin = json.dumps(out.finish_reason.value if out.finish_reason else None)
                    choice = (
                        f'{{"index":{i},"text":"","logprobs":null,"finish_reason":{fin}'
                        f"{weight_spans_json(out)}}}"
                    )
                    yield f'data: {head}"choices":[{choice}]{tail}\n\n'
            if include_usage:
                body = json.dumps(usage([finals[c.index] for c in choices]))
                yield f'data: {head}"choices":[],"usage":{body}{w}}}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            for h in handles:
                h.abort()
