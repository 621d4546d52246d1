"""Legacy `/v1/completions`: prompts as text or token ids, n choices per prompt from one prefill,
echo, the legacy logprobs shape and vLLM's scoring extensions; JSON and SSE bodies."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from omlx_logprobs.api.errors import APIError, error_body
from omlx_logprobs.api.protocol import CompletionRequest
from omlx_logprobs.api.serving import (
    Served,
    check_prompt_logprobs,
    encode,
    sampling_params,
    wait_all_or_disconnect,
)
from omlx_logprobs.engine.engine import RequestHandle
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.types import MAX_N, RequestOutput

MAX_PROMPTS = 256  # prompts in one request (lm-eval batches several)


@dataclass
class Choice:
    """One returned choice: its engine handle and what its JSON needs besides the outputs."""

    index: int
    handle: RequestHandle
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
            ids = encode(served.model, x, "prompt", special=True)
        else:
            ids = list(x)
        if not ids:
            raise APIError(f"prompt[{i}] has no tokens", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(f"prompt[{i}] holds an id that is not a token of this model", "prompt")
        out.append(list(ids))
    return out


def check_request(req: CompletionRequest, served: Served) -> None:
    served.check_model(req.model)
    served.checks.check(req)
    if req.suffix:
        raise APIError("suffix is not supported.", param="suffix")
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}.", param="n")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (no server-side ranking of choices).", "best_of")
    cap = served.cfg.max_top_logprobs
    if req.logprobs is not None and req.logprobs > cap:
        raise APIError(f"logprobs must be at most {cap}", param="logprobs")
    check_prompt_logprobs(req)


class CompletionServing:
    def __init__(self, served: Served) -> None:
        self.served = served
        vocab = served.model.vocab
        self.legacy = (LegacyLogprobFormatter(vocab), LegacyLogprobFormatter(vocab, as_ids=True))
        self.prompt_fmt = (PromptLogprobFormatter(vocab), PromptLogprobFormatter(vocab, True))

    def _start(self, req: CompletionRequest) -> list[Choice]:
        """Validate everything first, then submit: choice index = prompt * n + choice."""
        check_request(req, self.served)
        prompts = parse_prompts(req, self.served)
        # echo with logprobs needs the prompt's entries, with as many alternatives as logprobs
        wanted = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            wanted = max(wanted or 0, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        leaders = []
        for ids in prompts:
            params = sampling_params(
                req, self.served, len(ids), req.max_tokens, req.logprobs is not None,
                req.logprobs or 0, wanted,
            )  # fmt: skip
            leader = Sequence(rid, ids, params)
            for j in range(1, req.n):
                leader.fork(j)
            leaders.append(leader)
        loop = asyncio.get_running_loop()
        legacy = self.legacy[0]
        choices: list[Choice] = []
        for leader in leaders:
            echo = legacy.prompt_text(leader.prompt_ids) if req.echo else ""
            for handle in self.served.engine.add_group(leader, loop):
                choices.append(Choice(len(choices), handle, echo, LegacyCursor()))
        return choices

    def _logprobs(self, req: CompletionRequest, c: Choice, first: int, end: int) -> str:
        seq = c.handle.seq
        if seq.store is None:
            return "null"
        fixed = bool(req.logprob_token_ids)
        k = seq.store.k if fixed else (req.logprobs or 0)
        prompt = None
        if req.echo and not c.started:
            assert seq.prompt_store is not None
            prompt = (seq.prompt_ids, seq.prompt_store)
        fmt = self.legacy[req.return_tokens_as_token_ids]
        return fmt.json(c.cursor, k, prompt, seq.store, (first, end), fixed)

    def _extras(self, req: CompletionRequest, c: Choice, first: int, end: int) -> str:
        """vLLM's per-choice fields: prompt_logprobs, prompt_token_ids and token_ids."""
        seq = c.handle.seq
        out = ""
        if req.prompt_logprobs is not None and seq.prompt_store is not None:
            fmt = self.prompt_fmt[req.return_tokens_as_token_ids]
            k = req.prompt_logprobs
            out += (
                f',"prompt_logprobs":{fmt.json(seq.prompt_store, k, bool(req.logprob_token_ids))}'
            )
        if req.return_token_ids:
            if not c.started:
                out += f',"prompt_token_ids":{json.dumps(seq.prompt_ids)}'
            out += f',"token_ids":{json.dumps(seq.output_ids[first:end].tolist())}'
        return out

    def _head(self, c: Choice, obj: str) -> str:
        seq = c.handle.seq
        return (
            f'{{"id":"{seq.request_id}","object":"{obj}","created":{int(time.time())},'
            f'"model":{json.dumps(self.served.model.name)},'
        )

    async def complete(self, req: CompletionRequest, raw: Request) -> str:
        choices = self._start(req)
        try:
            outs = await wait_all_or_disconnect([c.handle for c in choices], raw)
        finally:
            abort_unfinished(self.served, choices)
        for out in outs:
            if out.error:
                raise APIError(out.error, status=500, type_="server_error")
        parts = []
        for c, out in zip(choices, outs):
            text = json.dumps(c.echo_text + out.text, ensure_ascii=False)
            lp = self._logprobs(req, c, 0, out.end_token)
            extras = self._extras(req, c, 0, out.end_token)
            finish = json.dumps(out.finish_reason.value if out.finish_reason else None)
            parts.append(
                f'{{"index":{c.index},"text":{text},"logprobs":{lp},'
                f'"finish_reason":{finish}{extras}}}'
            )
        usage = json.dumps(usage_of(choices, outs))
        head = self._head(choices[0], "text_completion")
        return f'{head}"choices":[{",".join(parts)}],"usage":{usage}}}'

    def stream(self, req: CompletionRequest) -> AsyncIterator[str]:
        choices = self._start(req)  # errors raise here, before the 200 starts
        return self._events(req, choices)

    async def _events(self, req: CompletionRequest, choices: list[Choice]) -> AsyncIterator[str]:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        tail = ',"usage":null}' if usage else "}"
        head = self._head(choices[0], "text_completion")
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merged([c.handle for c in choices]):
                c = choices[i]
                if out.error:
                    finals[i] = out
                    err = error_body(out.error, "server_error", None, None)
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                if out.text or out.end_token > out.first_token or not c.started:
                    text = json.dumps(
                        (c.echo_text if not c.started else "") + out.text, ensure_ascii=False
                    )
                    lp = self._logprobs(req, c, out.first_token, out.end_token)
                    extras = self._extras(req, c, out.first_token, out.end_token)
                    c.started = True
                    choice = (
                        f'{{"index":{i},"text":{text},"logprobs":{lp},'
                        f'"finish_reason":null{extras}}}'
                    )
                    yield f'data: {head}"choices":[{choice}]{tail}\n\n'
                if out.finished:
                    finals[i] = out
                    fin = json.dumps(out.finish_reason.value if out.finish_reason else None)
                    choice = f'{{"index":{i},"text":"","logprobs":null,"finish_reason":{fin}}}'
                    yield f'data: {head}"choices":[{choice}]{tail}\n\n'
            if usage:
                outs = [finals[c.index] for c in choices]
                body = json.dumps(usage_of(choices, outs))
                yield f'data: {head}"choices":[],"usage":{body}}}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            abort_unfinished(self.served, choices)


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come: (position in `handles`, output)."""
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        while True:
            out = await h.collector.get()
            queue.put_nowait((i, out))
            if out.finished:
                return

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, out = await queue.get()
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def abort_unfinished(served: Served, choices: list[Choice]) -> None:
    for c in choices:
        if c.handle.seq.finish_reason is None:
            served.engine.abort(c.handle.seq)


def usage_of(choices: list[Choice], outs: list[RequestOutput]) -> dict[str, Any]:
    """Each prompt counted once however many choices it has; every generated token counted."""
    firsts = [o for c, o in zip(choices, outs) if c.handle.seq.choice_index == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)},
    }
