"""LoRA adapters loaded and unloaded at run time, in vLLM's shapes: `POST /v1/load_lora_adapter`
and `POST /v1/unload_lora_adapter` (docs/specs/rl.md, "LoRA adapters"). A request then names an
adapter by `model`; the engine runs it beside the base model and the other adapters in one batch
(runner/lora.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.rl.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from omlx_logprobs.control import AdapterChange

log = logging.getLogger("omlx_logprobs")


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        base = req.base_model_name
        if base is not None and base not in pool.slots:
            adapter = base in pool.adapter_names()
            served = ", ".join(f"`{n}`" for n in pool.slots)
            raise APIError(
                f"`{base}` is {'a LoRA adapter' if adapter else 'not served'}: base_model_name"
                f" names one of the served models, {served}.",
                param="base_model_name",
                status=400 if adapter else 404,
                code=None if adapter else "model_not_found",
            )
        name, slot = req.lora_name, pool.slot(base)
        replace = req.load_inplace and name in slot.adapters
        if not replace:
            pool.check_new_name(name)  # a 400 when a model or another adapter has it
        # As given: the engine reads it (a relative one from the server's directory, which its
        # process shares), and so does a restarted engine process or a reload.
        path = req.lora_path
        pool.pending_adapters.add(name)
        try:
            async with pool.use(slot.name) as held:
                assert held.served is not None
                error = await held.served.engine.change_adapter(AdapterChange(name, path, replace))
                if error is None:
                    held.adapters[name] = path
        finally:
            pool.pending_adapters.discard(name)
        if error is not None:
            raise APIError(error, param="lora_path", code="adapter_not_loaded")
        verb = "replaced" if replace else "added"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {verb} successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = req.lora_name
        slot = next((s for s in pool.slots.values() if name in s.adapters), None)
        if slot is None:
            raise APIError(
                f"The LoRA adapter `{name}` is not loaded.",
                param="lora_name",
                status=404,
                code="adapter_not_found",
            )
        del slot.adapters[name]  # requests that name it from now on are 404s
        if slot.served is not None:  # requests running on it finish on it
            error = await slot.served.engine.change_adapter(AdapterChange(name))
            if error is not None:
                log.warning("unloading the adapter %s: %s", name, error)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
