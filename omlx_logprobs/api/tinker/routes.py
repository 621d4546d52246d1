"""Tinker's routes under /api/v1/ (the `tinker` SDK pointed at this server by its base URL):
the service's (api/tinker/service.py: client config, sessions, heartbeats, capabilities,
health), the training
model's (create_model, get_info, forward, forward_backward, optim_step,
save_weights_for_sampler; save_weights and load_weights, checkpoints in mlx-lm's format), the
checkpoints' (save_weights_external, copy_weights, the REST client's listings:
api/tinker/checkpoints.py), the sampler's (create_sampling_session, samplers, asample) and the
futures' (retrieve_future, cancel_future).
Every call that works answers with a future at once; the SDK polls it (api/tinker/futures.py).
A finished session's training runs are dropped, and so are those of a session whose heartbeats
stopped (api/tinker/expiry.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel as PydanticModel
from tinker import types

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.tinker import wire
from omlx_logprobs.api.tinker.checkpoints import Checkpoints, add_listing_routes
from omlx_logprobs.api.tinker.expiry import Expiry
from omlx_logprobs.api.tinker.futures import Futures
from omlx_logprobs.api.tinker.sampling import Sampling
from omlx_logprobs.api.tinker.service import add_service_routes, parse
from omlx_logprobs.api.tinker.sessions import Sessions
from omlx_logprobs.api.tinker.training import Training
from omlx_logprobs.config import TinkerConfig
from omlx_logprobs.training.store import CheckpointStore

API = "/api/v1"


class _CancelRequest(PydanticModel):
    """The SDK's cancel_future body (it has no type of its own)."""

    model_config = {"extra": "forbid"}
    request_id: str


def _future(rid: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"request_id": rid, "model_id": model_id, **extra}


def _calling(
    kind: type[PydanticModel], call: Callable[[Any], tuple[str, str]]
) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    """A route whose body is `kind` and whose answer is the future `call` makes of it."""

    async def route(raw: Request) -> dict[str, Any]:
        rid, model_id = call(await parse(raw, kind))
        return _future(rid, model_id)

    return route


def add_routes(app: FastAPI, pool: ModelPool, tinker: TinkerConfig | None = None) -> None:
    """`tinker`: where save_weights writes and when sessions expire (config.TinkerConfig)."""
    tinker = tinker or TinkerConfig()
    sessions, futures = Sessions(tinker.session_timeout_s), Futures()
    training = Training(pool, sessions, futures, CheckpointStore(tinker.dir))
    sampling = Sampling(pool, sessions, futures)
    expiry = Expiry(sessions, training.finish)
    checkpoints = Checkpoints(training, sessions, futures)

    add_service_routes(app, pool, sessions, training, expiry)

    # ---- training ----------------------------------------------------------------------------
    @app.post(f"{API}/get_info")
    async def get_info(raw: Request) -> dict[str, Any]:
        return training.info((await parse(raw, types.GetInfoRequest)).model_id)

    @app.post(f"{API}/forward_backward")
    async def forward_backward(raw: Request) -> dict[str, Any]:
        if raw.headers.get("content-encoding"):
            raise APIError("send forward_backward uncompressed (proto_compress_fwdbwd is off)")
        rid, model_id = training.forward_backward(await raw.body())
        return _future(rid, model_id)

    # The training calls whose body is one SDK request type and whose answer its future.
    calls: dict[str, tuple[type[PydanticModel], Callable[[Any], tuple[str, str]]]] = {
        "create_model": (types.CreateModelRequest, training.create_model),
        "optim_step": (types.OptimStepRequest, training.optim_step),
        "save_weights_for_sampler": (types.SaveWeightsForSamplerRequest, training.save_for_sampler),
        "save_weights": (types.SaveWeightsRequest, training.save),
        "load_weights": (types.LoadWeightsRequest, training.load),
        "save_weights_external": (types.SaveWeightsExternalRequest, checkpoints.save_external),
    }
    for name, (kind, call) in calls.items():
        app.add_api_route(f"{API}/{name}", _calling(kind, call), methods=["POST"], name=name)

    # ---- checkpoints -------------------------------------------------------------------------
    @app.post(f"{API}/copy_weights")
    async def copy_weights(raw: Request) -> dict[str, str]:
        return await checkpoints.copy(await parse(raw, types.CopyWeightsRequest))

    add_listing_routes(app, checkpoints)

    # ---- sampling ----------------------------------------------------------------------------
    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(raw: Request) -> dict[str, Any]:
        req = await parse(raw, types.CreateSamplingSessionRequest)
        sessions.session(req.session_id)
        if req.model_path is not None:
            found = sessions.by_path(req.model_path)
            made = sessions.add_sampler(found.base, found.adapter, found.path)
        elif req.base_model is not None:
            made = sessions.add_sampler(training.base(req.base_model), None, None)
        else:
            raise APIError("give model_path or base_model", param="base_model")
        return {"type": "create_sampling_session", "sampling_session_id": made.sampler_id}

    @app.get(API + "/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> dict[str, Any]:
        s = sessions.sampler(sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base, "model_path": s.path}

    @app.post(f"{API}/asample")
    async def asample(raw: Request) -> dict[str, Any]:
        rid, seq_ids = await sampling.asample(await parse(raw, types.SampleRequest))
        return _future(rid, sample_sequence_ids=seq_ids)

    # ---- futures -----------------------------------------------------------------------------
    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(raw: Request) -> Response:
        req = await parse(raw, types.FutureRetrieveRequest)
        result = await futures.retrieve(req.request_id)
        if result.proto is not None:
            return Response(result.proto, media_type=wire.PROTO)
        return JSONResponse(result.json)

    @app.post(f"{API}/cancel_future")
    async def cancel_future(raw: Request) -> None:
        body = await parse(raw, _CancelRequest)
        futures.cancel(body.request_id)
