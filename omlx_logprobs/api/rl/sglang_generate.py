"""SGLang's native `POST /generate` (slime, Miles, teacher scoring): one prompt or a batch, as
text or ids; per prompt `{"text", "output_ids", "meta_info"}` with SGLang's logprob lists,
`[logprob, id, text]` per position (`output_token_logprobs`, and from `logprob_start_len` on
`input_token_logprobs`, the first of them null), its finish reason object and the
`weight_version` string. Streamed, each event holds the whole answer so far (SGLang's
default)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from omlx_logprobs.api.core.errors import APIError, error_body
from omlx_logprobs.api.core.prepare import Ask, sampling_params, wire_names
from omlx_logprobs.api.core.prompts import encode
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.routed_experts import with_routing
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.rl.protocol import GenerateSampling, SglangGenerateRequest, SglangSampling
from omlx_logprobs.control import WeightVersion
from omlx_logprobs.logprobs.format import float_numbers
from omlx_logprobs.transport.client import RequestHandle, merged
from omlx_logprobs.types import EngineRequest, Entries, FinishReason, RequestOutput

MAX_PROMPTS = 256  # prompts in one batch, as /v1/completions
# vLLM's fields SGLang's are read into (`_engine_request`), by SGLang's names for the 400s
SGLANG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


@dataclass(frozen=True)
class Item:
    """One prompt of the request and what its answers report."""

    rid: str
    ids: list[int]
    sp: SglangSampling
    logprob: bool
    start: int  # the first prompt position with an input entry (its value is null)
    top: int
    token_ids: tuple[int, ...] | None  # token_ids_logprob


def per_prompt(value: Any, i: int, batch: bool, param: str = "input_ids") -> Any:
    """A per-prompt field's value for prompt i (a list gives one a prompt; for one prompt, a
    list of one); a 400 naming `param` when the list has no value for it."""
    if not isinstance(value, list):
        return value
    if batch and i < len(value):
        return value[i]
    if not batch and len(value) == 1:
        return value[0]
    raise APIError(f"{param}: one value a prompt is needed, {len(value)} given", param=param)


def weight_tag(version: WeightVersion) -> str:
    """SGLang's `weight_version` is a string: the tag the update was given, else the counter."""
    return version.tag if version.tag is not None else str(version.counter)


class SglangRun:
    """One /generate request (one prompt or a batch): checked and submitted at once (a bad
    request raises here, before any byte of a stream), then awaited whole or streamed."""

    def __init__(self, req: SglangGenerateRequest, served: Served) -> None:
        self.req, self.served = req, served
        self._text = served.token_texts
        self.eos = frozenset(served.model.eos_token_ids)
        self.items, self.handles, self.many, self.began = self._start(req)

    # ---- the request -----------------------------------------------------------------------------
    def _prompts(self, req: SglangGenerateRequest) -> tuple[list[list[int]], bool]:
        """Every prompt's ids, and whether the request is a batch."""
        served = self.served
        if (req.text is None) == (req.input_ids is None):
            raise APIError("Give exactly one of text and input_ids.", param="input_ids")
        if req.text is not None:
            texts = req.text if isinstance(req.text, list) else [req.text]
            for t in texts:
                served.checks.check_text(t, "text")
            prompts = [encode(served.model, t, "text", special=True) for t in texts]
            batch = isinstance(req.text, list)
        else:
            ids = req.input_ids or []
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if batch else [list(ids)]  # type: ignore[arg-type]
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise APIError(f"Send 1 to {MAX_PROMPTS} prompts.", param="input_ids")
        for p in prompts:
            if not p:
                raise APIError("A prompt has no tokens.", param="input_ids")
            served.checks.check_token_ids(p, "input_ids")
        return prompts, batch

    def _item(self, req: SglangGenerateRequest, i: int, ids: list[int], batch: bool) -> Item:
        sps = req.sampling_params
        sp = per_prompt(sps, i, batch, "sampling_params") if isinstance(sps, list) or batch else sps
        if isinstance(sp, list):  # one dict for one prompt, sent as a list
            sp = sp[0] if len(sp) == 1 else None
        sp = sp or SglangSampling.model_validate({})
        rid = per_prompt(req.rid, i, batch, "rid") if req.rid is not None else None
        start = per_prompt(req.logprob_start_len, i, batch, "logprob_start_len")
        if start == -1:
            start = len(ids) - 1
        if not 0 <= start < len(ids):
            raise APIError(
                f"logprob_start_len must be -1 or from 0 to the prompt's {len(ids) - 1}",
                param="logprob_start_len",
            )
        fixed = req.token_ids_logprob
        if fixed is not None and fixed and isinstance(fixed[0], list):
            fixed = per_prompt(fixed, i, True, "token_ids_logprob")
        top = per_prompt(req.top_logprobs_num, i, batch, "top_logprobs_num")
        if top < 0 or top > len(self.served.model.vocab):
            raise APIError("top_logprobs_num must be from 0 to the vocabulary's size",
                           param="top_logprobs_num")  # fmt: skip
        if fixed and top:
            raise APIError(
                "top_logprobs_num and token_ids_logprob together: this server reports one list"
                " of alternatives a position (ask for them in two requests)",
                param="token_ids_logprob",
            )
        want = bool(per_prompt(req.return_logprob, i, batch, "return_logprob"))
        if (top or fixed) and not want:
            param = "top_logprobs_num" if top else "token_ids_logprob"
            raise APIError(f"{param} needs return_logprob: true", param=param)
        return Item(
            str(rid) if rid is not None else uuid.uuid4().hex,
            ids,
            sp,
            want,
            start,
            int(top or 0),
            tuple(fixed) if fixed else None,  # type: ignore[arg-type]
        )

    def _engine_request(
        self, req: SglangGenerateRequest, item: Item, adapter: str | None
    ) -> EngineRequest:
        """The item as the engine's request: SGLang's names read into vLLM's fields (the same
        checks as every route)."""
        sp = item.sp
        structured = {"json": sp.json_schema, "regex": sp.regex, "grammar": sp.ebnf}
        # max_new_tokens as sent, checked against --max-output-tokens; SGLang's default (128)
        # is not the client's ask: it is bounded by the flag in `sampling_params`, never a 400
        sent = {"max_tokens": sp.max_new_tokens} if "max_new_tokens" in sp.model_fields_set else {}
        knobs = GenerateSampling.model_validate(
            dict(
                **sent, min_tokens=sp.min_new_tokens,
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                stop=sp.stop, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                skip_special_tokens=sp.skip_special_tokens,
                include_stop_str_in_output=sp.no_stop_trim,
                frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
                repetition_penalty=sp.repetition_penalty, n=sp.n, seed=sp.sampling_seed,
                logit_bias=sp.logit_bias, logprobs_mode=req.logprobs_mode,
                structured_outputs={k: v for k, v in structured.items() if v is not None} or None,
                logprob_token_ids=list(item.token_ids or ()) or None if item.logprob else None,
            )
        )  # fmt: skip
        checks = self.served.checks
        checks.check(sp)
        scored = item.logprob and item.start < len(item.ids) - 1
        ask = Ask(knobs, sp.max_new_tokens, item.logprob, item.top,
                  item.top if scored else None, prompt_param="input_ids")  # fmt: skip
        with wire_names(SGLANG_NAMES):  # a 400 names SGLang's field, not vLLM's
            constraint = checks.check(knobs)
            params = sampling_params(ask, self.served, len(item.ids), constraint)
        params, _ = with_routing(req, self.served, len(item.ids), params)
        rid = f"{item.rid}-{uuid.uuid4().hex[:8]}"  # unique in the engine whatever was sent
        return EngineRequest(rid, item.ids, params, sp.n, stream=req.stream, adapter=adapter)

    def _start(
        self, req: SglangGenerateRequest
    ) -> tuple[list[Item], list[RequestHandle], bool, float]:
        served = self.served
        served.check_model(served.model.name)  # an encoder embedding model: a 400
        served.checks.check(req)
        adapter = self._adapter(req)
        prompts, batch = self._prompts(req)
        items = [self._item(req, i, ids, batch) for i, ids in enumerate(prompts)]
        ereqs = [self._engine_request(req, item, adapter) for item in items]
        handles = [served.engine.submit(e) for e in ereqs]
        return items, handles, batch or any(i.sp.n > 1 for i in items), time.monotonic()

    def _adapter(self, req: SglangGenerateRequest) -> str | None:
        """SGLang names a loaded adapter by `lora_path`: one for the whole request here."""
        names = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path]
        if len(set(names)) > 1:
            raise APIError("One lora_path for every prompt of a request.", param="lora_path")
        name = names[0] if names else None
        if name is None:
            return None
        if self.served.adapter(name) is None:
            raise APIError(
                f"The LoRA adapter `{name}` is not loaded.", param="lora_path", status=404,
                code="adapter_not_found",
            )  # fmt: skip
        return name

    # ---- the answer -----------------------------------------------------------------------------
    def _triples(self, lps: list[str], ids: list[int], text: bool) -> str:
        """`[[logprob, id, text], ...]`; the text null unless asked."""
        texts = [self._text[t] for t in ids] if text else ["null"] * len(ids)
        return "[" + ",".join(f"[{v},{t},{s}]" for v, t, s in zip(lps, ids, texts)) + "]"

    def _lists(self, e: Entries, text: bool) -> tuple[str, list[str]]:
        """The entries' own [logprob, id, text] list and each position's alternatives."""
        own = self._triples(float_numbers(e.logprobs), e.token_ids.tolist(), text)
        k = e.k
        lps = float_numbers(e.top_logprobs.ravel()) if k else []
        ids = e.top_ids.ravel().tolist() if k else []
        tops = [self._triples(lps[i * k : (i + 1) * k], ids[i * k : (i + 1) * k], text)
                for i in range(len(e))]  # fmt: skip
        return own, tops

    def _logprobs(self, req: SglangGenerateRequest, item: Item, out: RequestOutput) -> str:
        """meta_info's logprob lists (from `"input_token_logprobs"` on, a JSON fragment)."""
        text = req.return_text_in_logprobs
        first = item.ids[item.start]
        first_text = self._text[first] if text else "null"
        ins, in_tops = [f"[null,{first},{first_text}]"], ["null"]
        scored = out.prompt_logprobs
        if scored is not None:  # positions 1.. of the prompt; the window starts after `start`
            own, tops = self._lists(scored.rows(item.start, len(scored)), text)
            if own != "[]":
                ins.append(own[1:-1])
            in_tops += tops
        e = out.logprobs if out.logprobs is not None else Entries.empty(0)
        own, tops = self._lists(e, text)
        body = f'"input_token_logprobs":[{",".join(ins)}],"output_token_logprobs":{own}'
        name = "token_ids" if item.token_ids else "top"
        if item.top or item.token_ids:
            body += f',"input_{name}_logprobs":[{",".join(in_tops)}]'
            body += f',"output_{name}_logprobs":[{",".join(tops)}]'
        return body

    def _finish(self, item: Item, out: RequestOutput) -> str | None:
        reason = out.finish_reason
        if reason is None:
            return None
        if reason is FinishReason.LENGTH:
            return json.dumps({"type": "length", "length": out.completion_tokens})
        if reason is FinishReason.ABORT:
            return json.dumps({"type": "abort", "message": "aborted"})
        if reason is FinishReason.ERROR:
            return json.dumps({"type": "abort", "message": out.error or "error"})
        return json.dumps({"type": "stop", "matched": self._matched(item, out)})

    def _matched(self, item: Item, out: RequestOutput) -> int | str | None:
        """What stopped the output: its last token when that is a stop token, else the stop
        string found first in its text."""
        ids = out.token_ids.tolist()
        stops = set(item.sp.stop_token_ids or ())
        if ids and (ids[-1] in stops or (ids[-1] in self.eos and not item.sp.ignore_eos)):
            return int(ids[-1])
        strings = [item.sp.stop] if isinstance(item.sp.stop, str) else item.sp.stop or []
        full = self.served.model.tokenizer.decode(ids)
        found = [(full.find(s), s) for s in strings if s and s in full]
        return min(found)[1] if found else None

    def _answer(
        self, req: SglangGenerateRequest, item: Item, out: RequestOutput, began: float
    ) -> str:
        finish = self._finish(item, out) or "null"
        meta = (
            f'"id":{json.dumps(item.rid)},"finish_reason":{finish},'
            f'"prompt_tokens":{out.prompt_tokens},"completion_tokens":{out.completion_tokens},'
            f'"cached_tokens":{out.cached_tokens},'
            f'"weight_version":{json.dumps(weight_tag(out.weight_version))}'
        )
        if out.adapter is not None:  # SGLang names it by lora_path; its load beside it
            meta += f',"adapter":{json.dumps(out.adapter.json())}'
        if out.weight_spans:  # the versions its tokens came from, and where each began
            spans = [{"weight_version": weight_tag(v), "start": a} for a, v in out.weight_spans]
            meta += f',"weight_versions":{json.dumps(spans)}'
        if item.logprob:
            meta += "," + self._logprobs(req, item, out)
        if out.routed_experts is not None:  # SGLang's: the base64 of the int32 ids, flat
            flat = base64.b64encode(out.routed_experts.astype("<i4").tobytes()).decode()
            meta += f',"routed_experts":"{flat}"'
        if out.finished:
            meta += f',"e2e_latency":{round(time.monotonic() - began, 6)}'
        return (
            f'{{"text":{json.dumps(out.text, ensure_ascii=False)},'
            f'"output_ids":{json.dumps(out.token_ids.tolist())},"meta_info":{{{meta}}}}}'
        )

    async def complete(self, raw: Request) -> str:
        req, items, many, began = self.req, self.items, self.many, self.began
        outs = await finished(self.handles, raw)
        per_item = [item for item in items for _ in range(item.sp.n)]
        answers = [self._answer(req, item, out, began) for item, out in zip(per_item, outs)]
        return f"[{','.join(answers)}]" if many else answers[0]

    async def events(self) -> AsyncIterator[str]:
        req, items, handles, many, began = self.req, self.items, self.handles, self.many, self.began
        so_far: dict[tuple[int, int], RequestOutput] = {}  # (prompt, choice): all it gained
        try:
            async for p, out in merged(handles):
                if out.error:
                    err = error_body(out.error, "server_error", None, None)
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                key = (p, out.index)
                whole = so_far[key].merge(out) if key in so_far else out
                so_far[key] = whole
                answer = self._answer(req, items[p], whole, began)
                if many:  # SGLang's batch events name their place in the batch
                    index = sum(i.sp.n for i in items[:p]) + out.index
                    answer = f'{{"index":{index},{answer[1:]}'
                yield f"data: {answer}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for h in handles:
                h.abort()
