"""`GET /health`: the pool's and its engines' state (api/core/pool.py); 503 when a loaded model's
engine is down."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from omlx_logprobs.api.core.pool import ModelPool


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        body, status = pool.health()
        return body if status == 200 else JSONResponse(body, status_code=status)
