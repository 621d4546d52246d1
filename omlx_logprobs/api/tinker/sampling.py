"""Tinker's `asample` (and so `compute_logprobs`, a sample of one token with prompt logprobs):
one engine request through the exact path the OpenAI routes take, on the base model or on the
adapter a sampler names, its choices and logprobs as the SDK's SampleResponse. Sampled tokens'
logprobs are the model's own (`raw_logprobs`: before temperature and the other processors),
what `forward` computes for them; prompt logprobs come from the same prefill. A prompt's image
chunks (api/tinker/prompt.py) are the engine request's images, as a chat's are; the positions
they take have no prompt logprob (None, as the OpenAI routes' null)."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
from tinker import types
from tinker.types.topk_logprobs import MASK_LOGPROB

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.kept_images import span
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.api.tinker import wire
from omlx_logprobs.api.tinker.futures import Failed, Futures, Result
from omlx_logprobs.api.tinker.prompt import Prompt, parse
from omlx_logprobs.api.tinker.sessions import Sampler, Sessions
from omlx_logprobs.types import EngineRequest, Entries, FinishReason, ImageInput, SamplingParams

DEFAULT_MAX_TOKENS = 16


class Sampling:
    def __init__(self, pool: ModelPool, sessions: Sessions, futures: Futures) -> None:
        self.pool, self.sessions, self.futures = pool, sessions, futures

    def sampler(self, req: types.SampleRequest) -> Sampler:
        if req.sampling_session_id is not None:
            return self.sessions.sampler(req.sampling_session_id)
        if req.model_path is not None:
            return self.sessions.by_path(req.model_path)
        if req.base_model is not None:
            if req.base_model not in self.pool.slots:
                raise APIError(f"The model `{req.base_model}` is not served here.",
                               param="base_model")  # fmt: skip
            return Sampler("", req.base_model, None, None)
        raise APIError("name a sampling_session_id, a model_path or a base_model")

    async def asample(self, req: types.SampleRequest) -> tuple[str, list[str]]:
        sampler = self.sampler(req)
        prompt = parse(req.prompt)
        if req.target_prompt_logprobs is not None or req.prompt_alt_tokens_k:
            raise APIError("target_prompt_logprobs and prompt_alt_tokens_k are not served yet")
        if req.record_stability_info:
            raise APIError(
                "record_stability_info is not served: the records the stable_reinforce loss"
                " reads are not kept here (train with importance_sampling, ppo, cispo or gspo)",
                param="record_stability_info",
            )
        if req.num_samples < 1:
            raise APIError("num_samples must be at least 1", param="num_samples")
        if not prompt.pictures:  # a text prompt's length is known before its model loads
            check_last_n(len(prompt.text_ids()), req)
        slot = self.pool.slots[sampler.base]
        ereq = None
        if slot.served is not None:  # loaded: checked now, else in the engine's model
            ereq = await self._request(slot.served, sampler, prompt, req)
        rid = self.futures.start("sample", self._run(sampler, prompt, ereq, req))
        return rid, [f"{rid}:{i}" for i in range(req.num_samples)]

    async def _request(
        self, served: Served, sampler: Sampler, prompt: Prompt, req: types.SampleRequest
    ) -> EngineRequest:
        """The engine's request of a checked prompt; its images read off the event loop
        (decoding and the processor's pass take from milliseconds to seconds)."""
        if prompt.pictures:
            ids, images = await asyncio.to_thread(prompt.expanded, served)
        else:
            ids, images = prompt.expanded(served)
        check(served.checks, ids, req)
        return EngineRequest(f"tinker-sample-{uuid.uuid4().hex}", ids,
                             params(req, len(ids), self.pool.limits.max_output_tokens),
                             req.num_samples, adapter=sampler.adapter,
                             images=images)  # fmt: skip

    async def _run(
        self,
        sampler: Sampler,
        prompt: Prompt,
        ereq: EngineRequest | None,
        req: types.SampleRequest,
    ) -> Result:
        async with self.pool.use(sampler.base) as slot:
            assert slot.served is not None
            try:
                if ereq is None:
                    ereq = await self._request(slot.served, sampler, prompt, req)
                else:
                    check(slot.served.checks, ereq.prompt_ids, req)
            except APIError as e:
                raise Failed(e.message) from None
            handle = slot.served.engine.submit(ereq)
            try:
                outs = await handle.final()
            finally:
                handle.abort()
        for out in outs:
            if out.error:
                raise Failed(out.error, user=False)
        seqs = [
            wire.Sequence(
                out.token_ids,
                None if out.logprobs is None else np.asarray(out.logprobs.logprobs),
                out.finish_reason is FinishReason.STOP,
                _top(out.logprobs, req.topk_sample_logprobs),
            )
            for out in sorted(outs, key=lambda o: o.index)
        ]
        scored = outs[0].prompt_logprobs
        lp, top = None, None
        if scored is not None:
            lp, top = prompt_arrays(scored, len(ereq.prompt_ids), req, ereq.images)
        return Result(proto=wire.sample_output(seqs, lp, top, outs[0].cached_tokens))


def _top(entries: Entries | None, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    if entries is None or k <= 0:
        return None
    return np.asarray(entries.top_ids)[:, :k], np.asarray(entries.top_logprobs)[:, :k]


def check(checks: RequestLimits, ids: list[int], req: types.SampleRequest) -> None:
    """The prompt's ids, its length with max_tokens against the context and memory, and the
    logprob counts against the server's limits: a 400 as the OpenAI routes answer."""
    checks.check_token_ids(ids, "prompt")
    check_last_n(len(ids), req)
    mt = req.sampling_params.max_tokens
    cap = checks.limits.max_output_tokens
    if mt is not None and cap is not None and mt > cap:  # --max-output-tokens, as every route
        raise APIError(f"max_tokens: at most {cap} allowed, got {mt}", param="max_tokens")
    checks.check_prompt(len(ids), DEFAULT_MAX_TOKENS if mt is None else mt, "prompt",
                        "max_tokens")  # fmt: skip
    top = checks.bounds.max_top_logprobs
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(req, name)
        if k < 0 or (top >= 0 and k > top):
            raise APIError(f"{name} must be from 0 to {top}", param=name)
    if req.num_samples > checks.limits.max_n:
        raise APIError(f"num_samples must be at most {checks.limits.max_n}", param="num_samples")


def check_last_n(n: int, req: types.SampleRequest) -> None:
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= n - 1:
        raise APIError("prompt_logprobs_last_n must be in [1, len(prompt) - 1]")


def params(req: types.SampleRequest, n_prompt: int, cap: int | None = None) -> SamplingParams:
    """`cap`: --max-output-tokens, which bounds the default (16) as every route's."""
    sp = req.sampling_params
    default = DEFAULT_MAX_TOKENS if cap is None else min(DEFAULT_MAX_TOKENS, cap)
    stop = sp.stop
    words = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str))
    tokens = tuple(int(s) for s in stop or () if isinstance(s, int) and not isinstance(stop, str))
    k = req.topk_prompt_logprobs
    scored = (req.prompt_logprobs or k > 0) and n_prompt > 1
    try:
        return SamplingParams(
            max_tokens=default if sp.max_tokens is None else sp.max_tokens,
            temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0), seed=sp.seed,
            stop=words, stop_token_ids=tokens, ignore_eos=stop is not None and len(stop) == 0,
            logprobs=True, top_logprobs=req.topk_sample_logprobs,
            prompt_logprobs=k if scored else None,
        )  # fmt: skip
    except ValueError as e:
        raise APIError(str(e), param="sampling_params") from None


def prompt_arrays(
    scored: Entries, n: int, req: types.SampleRequest, images: tuple[ImageInput, ...] = ()
) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
    """The prompt's logprobs [n] (NaN at position 0, before the last N asked for and at every
    position of an image chunk: not text, and not ids the client sent; the SDK reads NaN as
    None) and, if asked, its top-k [n, k] (the SDK's mask where there is none)."""
    skip = n - req.prompt_logprobs_last_n if req.prompt_logprobs_last_n else 1
    chunks = [slice(o, o + length) for o, length in map(span, images)]
    lp = None
    if req.prompt_logprobs:
        lp = np.full(n, np.nan, np.float32)
        lp[1:] = np.asarray(scored.logprobs, np.float32)
        lp[:skip] = np.nan
        for at in chunks:
            lp[at] = np.nan
    top = None
    k = req.topk_prompt_logprobs
    if k > 0:
        ids = np.zeros((n, k), np.int32)
        vals = np.full((n, k), MASK_LOGPROB, np.float32)
        ids[1:] = np.asarray(scored.top_ids)[:, :k]
        vals[1:] = np.asarray(scored.top_logprobs)[:, :k]
        ids[:skip], vals[:skip] = 0, MASK_LOGPROB
        for at in chunks:
            ids[at], vals[at] = 0, MASK_LOGPROB
        top = (ids, vals)
    return lp, top
