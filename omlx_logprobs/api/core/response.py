"""What the chat and the legacy completions responses share: every choice awaited (unless the
client leaves first), a failed choice as a 500, the body's head, the `usage` object, the
`weight_version` fragment and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import asyncio
import json
import time
from functools import lru_cache
from typing import Any

from fastapi import Request

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.protocol import SamplingKnobs
from omlx_logprobs.control import AdapterVersion, WeightVersion
from omlx_logprobs.logprobs.wire import LogprobWriter
from omlx_logprobs.transport.client import RequestHandle
from omlx_logprobs.types import Entries, ImageInput, RequestOutput


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


async def finished(handles: list[RequestHandle], raw: Request) -> list[RequestOutput]:
    """Every choice's merged outputs once all have finished; ConnectionAbortedError if the
    client left first; whatever is unfinished aborted either way; a failed choice a 500."""
    try:
        outs = await wait_or_disconnect(handles, raw)
    finally:
        for h in handles:
            h.abort()
    raise_if_failed(outs)
    return outs


def usage(outs: list[RequestOutput], reasoning: bool = False, reused: int = 0) -> dict[str, Any]:
    """The `usage` object of a response: each prompt counted once however many choices it has
    (its first choice's count), every generated token counted; with the thinking parser on,
    the reasoning tokens among them (else 0); `reused`: the prompt tokens that are earlier
    answers' sampled ids, sent back (api/core/splice.py)."""
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
            "reused_output_tokens": reused,
        },
        "completion_tokens_details": {  # OpenAI's keys, always present
            "reasoning_tokens": sum(o.reasoning_tokens for o in outs) if reasoning else 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": sum(o.accepted_prediction_tokens for o in outs),
            "rejected_prediction_tokens": sum(o.rejected_prediction_tokens for o in outs),
        },
    }


@lru_cache(maxsize=64)
def weight_version_json(version: WeightVersion, adapter: AdapterVersion | None = None) -> str:
    """`"weight_version":{...}`, the fragment every body and chunk carries: which weights made
    it (one version for a whole response, unless an update came while it was paused in place:
    then `weight_spans_json` says where each began), and beside it, for a response made with a
    LoRA adapter, `"adapter":{"name","load"}`: which adapter and which load of its name."""
    text = f',"weight_version":{json.dumps(version.json())}'
    return text if adapter is None else f'{text},"adapter":{json.dumps(adapter.json())}'


def weight_spans_json(out: RequestOutput) -> str:
    """`,"weight_versions":[...]` for a choice whose tokens came from more than one version
    (an update while it was paused in place): each version and the first token it made; ""
    for the rest (one version made it all, `weight_version` says which)."""
    if not out.weight_spans:
        return ""
    spans = [{**v.json(), "start": start} for start, v in out.weight_spans]
    return f',"weight_versions":{json.dumps(spans)}'


def raise_if_failed(outs: list[RequestOutput]) -> None:
    for out in outs:
        if out.error:
            raise APIError(out.error, status=500, type_="server_error")


def head(request_id: str, kind: str, model: str, fingerprint: str) -> str:
    """The opening of a body or chunk, up to its `choices`."""
    return (
        f'{{"id":"{request_id}","object":"{kind}","created":{int(time.time())},'
        f'"model":{json.dumps(model)},"system_fingerprint":"{fingerprint}",'
    )


def prompt_logprobs_fields(
    req: SamplingKnobs,
    e: Entries,
    writer: LogprobWriter,
    asked: int | None = None,
    images: tuple[ImageInput, ...] = (),
) -> str:
    """`,"prompt_logprobs":...`: vLLM's list (null for the first position) and, when the tail
    mass is asked, `prompt_tail_logprobs` beside it; or in the compact form one block of the
    positions after the first. `asked`: the alternatives wanted, when not the field's (chat
    echo asks for them). An image's placeholder positions are null: they are not text."""
    fixed = bool(req.logprob_token_ids)
    blank = frozenset(p for i in images for p in i.positions())
    k = e.k if fixed else ((req.prompt_logprobs if asked is None else asked) or 0)
    tails = writer.prompt_tails(e, k, fixed, blank)
    return f',"prompt_logprobs":{writer.prompt(e, k, fixed, blank)}{tails}'
