"""Several models in one server: each served name's engine and what every request on it reads
(its `Served`), loaded on demand and unloaded least recently used first within
`--max-loaded-models` and `--max-model-memory-mib` (docs/specs/rl.md, "Several models").

All of the pool's state changes on the event loop; loading and unloading an engine (seconds: a
child process starts and loads its weights, or stops) run in worker threads. A request holds a
lease on its model from the moment it is routed until its work is in the engine; from then on
the engine's own count of requests in flight keeps the model busy, so a busy model is never
unloaded and no response mixes two engines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from omlx_logprobs.api.core.bounds import model_bounds
from omlx_logprobs.api.core.description import Description
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.loading import Loading
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.slot import Loader, ModelSlot, TokenizerLoader
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import EngineConfig, Limits, PoolConfig
from omlx_logprobs.control import WeightVersion

# A model (a LoadedModel, perhaps without weights) -> (takes tools, reasons).
Traits = Callable[[Any], tuple[bool, bool]]
POLL_S = 0.05  # how often a request waiting for a busy model to go idle looks again
RETRY_AFTER_S = 5  # the 503's Retry-After: a busy model's requests take seconds to finish


class Unavailable(APIError):
    """The model cannot be loaded now (the others are busy): a 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(
            message, param="model", status=503, code="model_busy", type_="server_error"
        )
        self.retry_after_s = retry_after_s


class ModelPool(Loading):
    """The served models by name; the first is the default of routes that name none. Its loads
    and unloads: api/core/loading.py."""

    def __init__(
        self,
        slots: list[ModelSlot],
        load: Loader | None = None,
        cfg: PoolConfig | None = None,
        limits: Limits | None = None,
        engine: EngineConfig | None = None,
        load_tokenizer: TokenizerLoader | None = None,
        ignore_unknown_fields: bool = False,
        traits: Traits | None = None,
    ) -> None:
        self.load_tokenizer = load_tokenizer
        # Whether a model takes tools and reasons as served, from its tokenizer alone (the
        # server's parser settings applied): /v1/models says so before it loads.
        self.traits = traits
        # --ignore-unknown-fields (one setting for every model): checked before any load
        self.ignore_unknown_fields = ignore_unknown_fields
        self.slots: dict[str, ModelSlot] = {}
        for s in slots:
            if s.name in self.slots:
                raise ValueError(
                    f"two models are served as `{s.name}`: give each a name of its own"
                    " (--served-model-name, once per --model)"
                )
            self.slots[s.name] = s
        self.pending_adapters: set[str] = set()  # names being loaded: taken
        taken = set(self.slots)
        for name in (a for s in slots for a in s.adapters):
            if name in taken:
                raise ValueError(f"`{name}` names two of the served models and LoRA adapters")
            taken.add(name)
        self.default = slots[0]
        self.load = load
        self.cfg = cfg or PoolConfig()
        self.limits = limits or Limits()
        self.engine = engine or EngineConfig()
        self.closing = False
        self._threads: ThreadPoolExecutor | None = None  # loads and unloads, made on first use
        # What an API package keeps across requests beside the models (the Responses store),
        # reported by /health under its name: the packages above register it, core imports none
        self.reports: dict[str, Callable[[], dict[str, Any]]] = {}
        budget = self.cfg.memory_mib
        for s in slots:
            if budget is not None and s.need_mib > budget:
                raise ValueError(
                    f"model {s.name} needs about {s.need_mib} MiB, more than"
                    f" --max-model-memory-mib {budget}"
                )

    @classmethod
    def single(cls, served: Served) -> ModelPool:
        """One model, already loaded (the engine starts with the app)."""
        slot = ModelSlot(served.model.name, None)
        slot.attach(served)
        return cls(
            [slot],
            limits=served.limits,
            engine=served.cfg,
            ignore_unknown_fields=served.ignore_unknown_fields,
        )

    # ---- start and stop ------------------------------------------------------------------------
    def load_at_start(self) -> None:
        """The default model, then the others in order while they fit (the rest load on their
        first request); engines start with the app."""
        assert self.load is not None
        for slot in self.slots.values():
            if slot is self.default or self._fits(slot, self._resident(slot)):
                slot.attach(self.load(slot))
                slot.loads += 1

    def start(self) -> None:
        for slot in self.slots.values():
            if slot.served is not None:
                slot.served.engine.start()

    def begin_shutdown(self, grace_s: float) -> None:
        """Safe in a signal handler."""
        self.closing = True
        for slot in list(self.slots.values()):
            if slot.served is not None:
                slot.served.engine.begin_shutdown(grace_s)

    def shutdown(self) -> None:
        self.closing = True
        for slot in self.slots.values():
            if slot.served is not None:
                slot.served.engine.shutdown()
        if self._threads is not None:  # a load in progress stops its own engine (_start)
            self._threads.shutdown(wait=True, cancel_futures=True)

    # ---- routing -------------------------------------------------------------------------------
    def slot(self, name: str | None) -> ModelSlot:
        """The slot of a served name (None: the default); a 404 naming the served ones."""
        if name is None:
            return self.default
        slot = self.slots.get(name) or next(
            (s for s in self.slots.values() if name in s.adapters), None
        )
        if slot is None:
            names = ", ".join(f"`{n}`" for n in [*self.slots, *self.adapter_names()])
            raise APIError(
                f"The model `{name}` does not exist. This server serves {names}.",
                param="model",
                status=404,
                code="model_not_found",
            )
        return slot

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[ModelSlot]:
        """The model, loaded (a request waits for its load); held until the block ends."""
        slot = await self.acquire(name)
        try:
            yield slot
        finally:
            slot.leases -= 1
            slot.last_used = time.monotonic()

    async def acquire(self, name: str | None) -> ModelSlot:
        slot = self.slot(name)
        arrived = time.monotonic()
        try:
            return await self._acquire(slot, arrived)
        finally:
            if arrived in slot.blocked:
                slot.blocked.remove(arrived)

    async def _acquire(self, slot: ModelSlot, arrived: float) -> ModelSlot:
        deadline = arrived + self.cfg.load_timeout_s
        while True:
            if slot.state == "loaded":
                if self._yields(slot, arrived):
                    await asyncio.sleep(POLL_S)
                    continue
                slot.leases += 1
                slot.last_used = time.monotonic()
                return slot
            if slot.change is not None:  # loading (shared by every request for it), unloading
                loading = slot.state == "loading"
                try:
                    await asyncio.shield(slot.change)
                except Exception as e:
                    if loading:
                        raise APIError(
                            f"The model `{slot.name}` could not be loaded: {e}",
                            param="model",
                            status=500,
                            code="model_not_loaded",
                            type_="server_error",
                        ) from None
                continue
            if self.closing:
                raise Unavailable("The server is shutting down.")
            victims = self._plan(slot)
            if victims is not None:
                self._begin_load(slot, victims)
                continue
            if arrived not in slot.blocked:
                slot.blocked.append(arrived)
            if time.monotonic() >= deadline:
                busy = ", ".join(f"`{s.name}`" for s in self._resident(slot))
                raise Unavailable(
                    f"The model `{slot.name}` is not loaded, and loading it means unloading one"
                    f" of {busy}, which stayed busy for {self.cfg.load_timeout_s:g} s"
                    " (--model-load-timeout-s). Retry later."
                )
            await asyncio.sleep(POLL_S)

    def adapter_names(self) -> list[str]:
        return [a for s in self.slots.values() for a in s.adapters]

    def check_new_name(self, name: str) -> None:
        """A 400 unless `name` is free for a new adapter (no model, adapter or load has it)."""
        if name in self.slots or name in self.adapter_names() or name in self.pending_adapters:
            what = "a served model" if name in self.slots else "a LoRA adapter"
            raise APIError(
                f"The name `{name}` is taken: {what} is served under it.",
                param="lora_name",
                code="adapter_exists",
            )

    def _yields(self, slot: ModelSlot, arrived: float) -> bool:
        """Whether a request for a loaded model waits: it came after the model was loaded, and a
        request for another model that came before it waits for the loaded ones to go idle.
        Requests that waited for the load all go in with it; later ones queue behind the
        other model's (first come, first served, a load serving everything waiting for it)."""
        if arrived < slot.loaded_at:
            return False
        return any(
            s.blocked and min(s.blocked) < arrived for s in self.slots.values() if s is not slot
        )

    async def tokenizer(self, name: str | None) -> tuple[Any, RequestLimits]:
        """The model's tokenizer and facts (a LoadedModel, perhaps without its weights) and its
        request limits, without loading the weights of a model that is not loaded."""
        slot = self.slot(name)
        if slot.served is not None:
            return slot.served.model, slot.served.checks
        if slot.tokenizer is None:
            if self.load_tokenizer is None:  # no way to the tokenizer alone: load the model
                async with self.use(name) as held:
                    assert held.served is not None
                    return held.served.model, held.served.checks
            model = await self._in_thread(self.load_tokenizer, slot)
            checks = RequestLimits(self.limits, model_bounds(model, self.engine.max_top_logprobs))
            slot.tokenizer = (model, checks)
        return slot.tokenizer

    def updated(self, slot: ModelSlot, path: str, version: WeightVersion) -> None:
        """New weights serve on this model: a later reload loads them under the same version."""
        slot.weights_path, slot.weights = path, version

    # ---- reports -------------------------------------------------------------------------------
    @property
    def sleeping(self) -> int:
        """The deepest sleep level of the loaded models (POST /sleep, api/rl/sleep.py), else 0:
        requests that compute are refused until /wake_up. Read from the engines, the one place
        it is kept, so that an engine process started again (awake) is not reported asleep."""
        levels = [s.served.engine.snapshot().sleeping for s in self.slots.values() if s.served]
        return max(levels, default=0)

    def health(self) -> tuple[dict[str, Any], int]:
        """/health: the default model's fields at the top (as with one model), every model's
        state under `models`; 503 when a loaded model's engine is down."""
        models: dict[str, dict[str, Any]] = {}
        status, code = "ok", 200
        for s in self.slots.values():
            entry: dict[str, Any] = {
                "state": s.state,
                "loaded": s.state == "loaded",
                "running": 0,
                "weight_version": s.weights.json(),
                "adapters": list(s.adapters),
                "memory_mib": s.need_mib,
                "engine": None,
                "sampled_store": None,
            }
            if s.served is not None:
                stats = asdict(s.served.engine.snapshot())
                entry.update(
                    running=stats["waiting"] + stats["running"],
                    weight_version=stats["weights"],
                    engine=stats,
                    # the answers' sampled ids kept for conversations sent back
                    sampled_store=s.served.sampled.report(),
                )
                state = s.served.engine.state
                if state != "ok" and code == 200:  # the engine process is gone (restarting...)
                    status = f"engine {state}" if s is self.default else f"{s.name}: engine {state}"
                    code = 503
            models[s.name] = entry
        first = models[self.default.name]
        body = {
            "status": status,
            "running": sum(m["running"] for m in models.values()),
            "weight_version": first["weight_version"],
            "engine": first["engine"],
            "sampled_store": first["sampled_store"],
            "models": models,
            **{name: report() for name, report in self.reports.items()},
        }
        return body, code

    def cards(self, created: int, described: dict[str, Description]) -> list[dict[str, Any]]:
        """/v1/models: every served model, loaded or not, with what an agent sizes its context
        from (vLLM's `max_model_len`; `context_length` and LM Studio's `max_context_length`,
        the same number) and what the model takes (api/core/description.py)."""
        out = []
        for s in self.slots.values():
            d = described[s.name]
            card: dict[str, Any] = {
                "id": s.name,
                "object": "model",
                "created": created,
                "owned_by": "omlx_logprobs",
                "max_model_len": d.max_model_len,
                "context_length": d.max_model_len,
                "max_context_length": d.max_model_len,
                "capabilities": d.capabilities(),
                "loaded": s.state == "loaded",
            }
            out.append(card)
            for name, path in s.adapters.items():  # vLLM's card of a LoRA adapter
                out.append({
                    **card, "id": name, "root": path, "parent": s.name,
                })  # fmt: skip
        return out
