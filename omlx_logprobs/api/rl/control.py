"""The RL control plane in vLLM's and SGLang's shapes (docs/specs/rl.md): `/pause` (modes
abort, wait, keep) and `/resume`, `/is_paused`; SGLang's `/pause_generation` (abort, retract,
in_place) and `/continue_generation`; `/flush_cache` and `/reset_prefix_cache`. Each applies to
every loaded model: a trainer pauses the server, not one of its models."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.rl.protocol import PauseGenerationRequest
from omlx_logprobs.control import Control, ControlResult, PauseMode

# SGLang's names for the modes
SGLANG_MODES = {"abort": PauseMode.ABORT, "retract": PauseMode.RETRACT, "in_place": PauseMode.KEEP}


async def run(pool: ModelPool, command: Control) -> list[ControlResult]:
    """The command on every loaded model's engine; a 500 naming why one failed."""
    results = []
    for slot in list(pool.slots.values()):
        if slot.served is not None:
            results.append(await slot.served.engine.control(command))
    for r in results:
        if r.error is not None:
            raise APIError(r.error, status=500, type_="server_error")
    return results


async def no_fields(request: Request) -> None:
    """Routes that take no body: an empty one, or `{}`, as vLLM's and SGLang's clients send;
    anything else is a 400 (a field is never silently ignored)."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise APIError("the body is not JSON (this route takes none)") from None
    if body == {}:
        return
    if isinstance(body, dict):
        name = next(iter(body))
        raise APIError(
            f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter"
        )
    raise APIError("this route takes no body (or an empty JSON object)")


NO_FIELDS = [Depends(no_fields)]


def summary(results: list[ControlResult]) -> dict[str, Any]:
    return {"aborted": sum(r.aborted for r in results), "held": sum(r.held for r in results)}


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/pause", dependencies=NO_FIELDS)
    async def pause(
        mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True
    ) -> dict[str, Any]:
        """vLLM's: abort (default) ends the requests in flight, wait lets them finish first,
        keep stops them where they are; new requests wait for /resume in every mode."""
        results = await run(pool, Control("pause", PauseMode(mode)))
        if clear_cache and mode != "keep":  # vLLM: kept requests keep their cache
            await run(pool, Control("flush"))
        return {"status": "paused", **summary(results)}

    @app.post("/resume", dependencies=NO_FIELDS)
    async def resume() -> dict[str, Any]:
        await run(pool, Control("resume"))
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        states = [s.served.engine.snapshot().paused for s in pool.slots.values() if s.served]
        return {"is_paused": any(p is not None for p in states)}

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest | None = None) -> dict[str, Any]:
        """SGLang's: abort, retract (the requests' keys and values go; they are prefilled
        again on /continue_generation) or in_place (kept where they are)."""
        mode = SGLANG_MODES[req.mode if req is not None else "abort"]
        results = await run(pool, Control("pause", mode))
        return {"message": "Generation paused successfully.", "status": "ok", **summary(results)}

    @app.post("/continue_generation", dependencies=NO_FIELDS)
    async def continue_generation() -> dict[str, Any]:
        await run(pool, Control("resume"))
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def flush_cache() -> PlainTextResponse:
        """SGLang's: the kept prompt prefixes go (requests running keep their own rows)."""
        await run(pool, Control("flush"))
        return PlainTextResponse("Cache flushed.\n")

    # One route per method: OpenAPI names each operation once.
    for method in ("GET", "POST"):
        app.add_api_route(
            "/flush_cache",
            flush_cache,
            methods=[method],
            dependencies=NO_FIELDS,
            operation_id=f"flush_cache_{method.lower()}",
        )

    @app.post("/reset_prefix_cache", dependencies=NO_FIELDS)
    async def reset_prefix_cache() -> Response:
        """vLLM's: the same, answered with an empty 200."""
        await run(pool, Control("flush"))
        return Response(status_code=200)
