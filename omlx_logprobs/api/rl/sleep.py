"""vLLM's sleep mode for a trainer in another process (docs/specs/rl.md, "Sleep and wake"):
`POST /sleep?level=1|2` releases the prefix cache and MLX's buffer cache (level 2: the weights
too), `POST /wake_up` brings them back, `GET /is_sleeping`; and `POST /collective_rpc` with
`reload_weights`, the weights read again from disk. Each applies to every loaded model."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import Response

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.rl.control import NO_FIELDS, run
from omlx_logprobs.api.rl.protocol import CollectiveRpcRequest
from omlx_logprobs.api.rl.weights import load
from omlx_logprobs.control import Control, WeightUpdate

LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")  # vLLM's: what a wake_up reallocates (here: one wake, all)


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/sleep", dependencies=NO_FIELDS)
    async def sleep(level: int = 1) -> Response:
        """Requests in flight end (finish reason abort); until /wake_up, requests that compute
        are a 503 (vLLM's ModelSleepingError) and the rest (tokenize, models) still serve."""
        if level not in LEVELS:
            raise APIError(f"level must be 1 or 2, not {level}", param="level")
        split = [n for n, s in pool.slots.items() if s.served and s.served.cfg.parallel]
        if level == 2 and split:  # each process holds its share: all would have to drop it
            raise APIError(
                f"level 2 cannot drop the weights of `{split[0]}`: it is split over processes"
                " (level 1 releases the caches)",
                param="level",
            )
        # The engines keep the level (their /health stats): /is_sleeping reads it from them.
        await run(pool, Control("sleep", level=level))
        return Response(status_code=200)

    @app.post("/wake_up", dependencies=NO_FIELDS)
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        """Weights dropped at level 2 are read again from where they last came: the last
        weights loaded in place, else the model's directory. `tags` (vLLM's partial wake) are
        checked and accepted; one wake restores everything (unified memory: nothing to
        reallocate apart)."""
        for tag in tags or ():
            if tag not in TAGS:
                raise APIError(f"unknown tag {tag!r}: tags are weights and kv_cache", param="tags")
        for slot in list(pool.slots.values()):
            if slot.served is not None:
                path = slot.weights_path or slot.source
                result = await slot.served.engine.control(Control("wake", path=path))
                if result.error is not None:
                    raise APIError(result.error, status=500, type_="server_error")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": pool.sleeping > 0}  # an engine started again is awake

    @app.post("/collective_rpc")
    async def collective_rpc(req: CollectiveRpcRequest) -> dict[str, Any]:
        """vLLM's worker methods by name; here `reload_weights` alone: the default model's
        weights read again from `weights_path` (keyword, or the first argument), else from its
        directory, as a new weight version. Asleep at level 2, this brings the weights back."""
        if req.method != "reload_weights":
            raise APIError(
                f"collective_rpc method {req.method!r} is not supported: only reload_weights",
                param="method",
            )
        extra = set(req.kwargs) - {"weights_path"}
        if extra or len(req.args) > 1:
            name = f"kwargs.{sorted(extra)[0]}" if extra else "args"
            raise APIError("reload_weights takes one argument, weights_path", param=name)
        path = req.kwargs.get("weights_path", req.args[0] if req.args else None)
        if path is None:
            path = pool.slot(None).source
        if not isinstance(path, str):
            raise APIError("weights_path must be a path", param="kwargs.weights_path")
        # Shielded: past the timeout the reload goes on and is still recorded for a reload of
        # the model (pool.updated).
        update = asyncio.ensure_future(load(pool, None, WeightUpdate(path), "weights_path"))
        try:
            await asyncio.wait_for(asyncio.shield(update), req.timeout)
        except TimeoutError:
            raise APIError(
                f"reload_weights took longer than {req.timeout} s (it still completes)",
                status=504,
                type_="server_error",
            ) from None
        return {"results": [None]}
