"""New weights in place, in SGLang's shape: `POST /update_weights_from_disk` (docs/specs/rl.md). The
engine swaps them between two steps (runner/weights.py reads and checks them); the pool keeps
them for a later reload of the model."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.rl.protocol import UpdateWeightsDirRequest, UpdateWeightsRequest
from omlx_logprobs.control import WeightUpdate, WeightUpdateResult


async def load(
    pool: ModelPool, model: str | None, update: WeightUpdate, param: str
) -> WeightUpdateResult:
    """New weights on a served model (loaded first if need be); a 400 naming `param` when
    they are not loaded."""
    async with pool.use(model) as slot:
        assert slot.served is not None
        result = await slot.served.engine.update_weights(update)
        if result.error is None:
            pool.updated(slot, update.path, result.version)
    if result.error is not None:
        raise APIError(result.error, param=param, code="weights_not_loaded")
    return result


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/update_weights")
    async def update_weights_dir(req: UpdateWeightsDirRequest) -> dict[str, Any]:
        """prime-rl's: the weights in `weight_dir` serve from now on. Requests in flight
        finish on the old weights first, unless the server is paused in place (keep,
        in_place, retract): then they continue on the new ones after the resume, prefilled
        again, and their responses name both versions (docs/specs/rl.md)."""
        pool.slot(req.model)
        if req.model is not None and req.model in pool.adapter_names():
            raise APIError(f"`{req.model}` is a LoRA adapter", param="model")
        update = WeightUpdate(req.weight_dir, False, req.weight_version)
        result = await load(pool, req.model, update, "weight_dir")
        return {"status": "ok", "weight_version": result.version.json()}

    @app.post("/update_weights_from_disk")
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        pool.slot(req.model)  # an unknown name is a 404 before anything else
        if req.model is not None and req.model in pool.adapter_names():
            raise APIError(
                f"`{req.model}` is a LoRA adapter: name its base model, or replace the adapter"
                " with /v1/load_lora_adapter (load_inplace)",
                param="model",
            )
        if not req.flush_cache:  # kept keys and values of the old weights: wrong numbers
            raise APIError(
                "flush_cache must be true: the prefix cache always goes with the old weights",
                param="flush_cache",
            )
        if req.load_format not in (None, "auto", "safetensors"):
            raise APIError("load_format must be safetensors", param="load_format")
        abort = req.abort_in_flight or req.abort_all_requests
        update = WeightUpdate(req.model_path, abort, req.weight_version)
        result = await load(pool, req.model, update, "model_path")
        return {
            "success": True,
            "message": f"weights from {req.model_path} serve from now on",
            "weight_version": result.version.json(),
            "aborted_requests": result.aborted,
            "seconds": round(result.seconds, 3),
        }
