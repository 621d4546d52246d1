"""Tinker's service routes under /api/v1/: health, the client's configuration, sessions (made,
kept alive by heartbeats, finished; the REST client's listing and reading of them) and the
server's capabilities; and `parse`, how every Tinker route reads its body."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel as PydanticModel
from pydantic import ValidationError
from tinker import types

from omlx_logprobs.api.core.errors import APIError, invalid_body
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.tinker.checkpoints import page_of
from omlx_logprobs.api.tinker.expiry import Expiry
from omlx_logprobs.api.tinker.sessions import Sessions
from omlx_logprobs.api.tinker.training import Training

API = "/api/v1"
M = TypeVar("M", bound=PydanticModel)


async def parse(raw: Request, model: type[M]) -> M:
    """The body as the SDK's request type; a 400 naming what does not fit."""
    try:
        return model.model_validate(await raw.json())
    except ValidationError as e:
        raise invalid_body(e.errors()) from None
    except ValueError:
        raise APIError("the body is not JSON") from None


def add_service_routes(
    app: FastAPI, pool: ModelPool, sessions: Sessions, training: Training, expiry: Expiry
) -> None:
    """`training` finishes a session (its runs dropped from their engines); `expiry` watches
    the sessions once one is open."""

    @app.get(f"{API}/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(f"{API}/client/config")
    async def client_config() -> dict[str, Any]:
        # httpx's transport, and forward_backward chunks one after the other: the trainer runs
        # a model's calls in order anyway.
        return {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False}

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        # an abandoned sample is cancelled (cancel_future), its engine request aborted
        return {"sample_cancel_enabled": True}

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.post(f"{API}/create_session")
    async def create_session(raw: Request) -> dict[str, Any]:
        req = await parse(raw, types.CreateSessionRequest)
        sid = sessions.open(req.user_metadata, req.display_name)
        expiry.watch()
        return {"type": "create_session", "session_id": sid}

    @app.post(f"{API}/session_heartbeat")
    async def session_heartbeat(raw: Request) -> dict[str, str]:
        req = await parse(raw, types.SessionHeartbeatRequest)
        sessions.session(req.session_id)
        return {"type": "session_heartbeat"}

    @app.post(API + "/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> None:
        await training.finish(session_id)

    @app.get(f"{API}/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        page, _ = page_of(sorted(sessions.sessions), limit, offset)
        return {"sessions": page}

    @app.get(API + "/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        return sessions.described(session_id)

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        models = [{"model_name": name, "trainable": True, "sampleable": True,
                   "max_context_length": slot.max_model_len}
                  for name, slot in pool.slots.items()]  # fmt: skip
        return {"supported_models": models}
