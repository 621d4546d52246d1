"""Loading and unloading the pool's models (api/core/pool.py's `ModelPool` is a `Loading`): which
idle models make room for a load, least recently used first, within `--max-loaded-models` and
`--max-model-memory-mib`, and the loads and unloads themselves, in worker threads while the event
loop goes on serving."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.slot import Loader, ModelSlot
from omlx_logprobs.config import PoolConfig

log = logging.getLogger("omlx_logprobs")


class Loading:
    """ModelPool's loads and unloads; the pool holds the state they read and change."""

    slots: dict[str, ModelSlot]
    load: Loader | None
    cfg: PoolConfig
    closing: bool
    _threads: ThreadPoolExecutor | None

    def _resident(self, slot: ModelSlot) -> list[ModelSlot]:
        """The other models that hold memory or soon will (an unloading one is awaited by the
        next load before it starts)."""
        return [
            s for s in self.slots.values() if s is not slot and s.state in ("loaded", "loading")
        ]

    def _fits(self, slot: ModelSlot, others: list[ModelSlot]) -> bool:
        cfg = self.cfg
        if cfg.max_loaded is not None and len(others) + 1 > cfg.max_loaded:
            return False
        used = sum(s.need_mib for s in others)
        return cfg.memory_mib is None or used + slot.need_mib <= cfg.memory_mib

    def _plan(self, slot: ModelSlot) -> list[ModelSlot] | None:
        """The idle models to unload, least recently used first, for `slot` to fit; None when
        it cannot fit until a busy one goes idle."""
        resident = self._resident(slot)
        idle = sorted(
            (s for s in resident if s.state == "loaded" and not s.busy), key=lambda s: s.last_used
        )
        victims: list[ModelSlot] = []
        while not self._fits(slot, [s for s in resident if s not in victims]):
            if not idle:
                return None
            victims.append(idle.pop(0))
        return victims

    def _begin_load(self, slot: ModelSlot, victims: list[ModelSlot]) -> None:
        for v in victims:
            v.state = "unloading"
            v.change = _task(self._unload(v, v.detach()))
        slot.state = "loading"
        slot.change = _task(self._load(slot))

    async def _load(self, slot: ModelSlot) -> None:
        try:
            # Memory first goes back: every unload in progress ends before the load begins.
            unloading = [s.change for s in self.slots.values() if s.state == "unloading"]
            await asyncio.gather(*[t for t in unloading if t is not None], return_exceptions=True)
            began = time.monotonic()
            served = await self._in_thread(self._start, slot)
        except BaseException:
            slot.state, slot.change = "unloaded", None
            raise
        slot.attach(served)
        slot.change = None
        slot.loads += 1
        log.info(
            "model %s loaded in %.1f s (loaded now: %s)",
            slot.name,
            time.monotonic() - began,
            ", ".join(s.name for s in self.slots.values() if s.state == "loaded"),
        )

    def _start(self, slot: ModelSlot) -> Served:
        assert self.load is not None
        served = self.load(slot)
        served.engine.start()
        if self.closing:  # the app is gone or going: nobody would stop this engine
            served.engine.shutdown()
            raise RuntimeError("the server is shutting down")
        return served

    async def _unload(self, slot: ModelSlot, served: Served) -> None:
        try:
            await self._in_thread(_stop, served)
        finally:
            slot.state, slot.change = "unloaded", None
        log.info("model %s unloaded (idle, least recently used)", slot.name)

    async def _in_thread(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(4, thread_name_prefix="omlx-load")
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, arg)


def _task(coro: Any) -> asyncio.Task[None]:
    task = asyncio.ensure_future(coro)
    # A load whose requests all left still fails quietly here, not as "never retrieved".
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _stop(served: Served) -> None:
    """The engine stopped: its child process exits (its memory goes back to the system), or its
    thread ends and MLX's freed buffers are released."""
    served.engine.shutdown()
    del served
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()
