"""The training calls behind Tinker's routes: each checked here (a 400 before any work), then
run as a future (api/tinker/futures.py) that posts the engine one training call at a time
(engine/commands.py's `Train`): a forward_backward is one call, whose datums the engine takes
in padded forwards of as many as it admits when each runs (engine/trainings.py), stepping its
requests between them."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from tinker import types

from omlx_logprobs.api.core.bounds import ModelBounds
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.tinker import wire
from omlx_logprobs.api.tinker.futures import Failed, Futures, Result
from omlx_logprobs.api.tinker.sessions import SNAPSHOTS, Sessions, TrainingModel, metadata
from omlx_logprobs.control import AdapterChange
from omlx_logprobs.engine.commands import Train
from omlx_logprobs.training import checkpoint, losses
from omlx_logprobs.training.calls import (
    AdamSpec,
    BatchPass,
    CreateRun,
    DatumPass,
    DatumResult,
    DropRun,
    LoadRun,
    LoraSpec,
    OptimStep,
    Publish,
    SaveRun,
    TrainCall,
)
from omlx_logprobs.training.store import PREFIX, CheckpointStore, check_ttl

# Copies of a datum's [tokens, vocabulary] float32 logits a forward and backward hold at once.
TRAIN_LOGIT_COPIES = 4


def checked_ttl(ttl_seconds: int | None) -> int | None:
    """A checkpoint's time to live as Tinker bounds it (training/store.py), else a 400."""
    try:
        check_ttl(ttl_seconds)
    except checkpoint.CheckpointError as e:
        raise APIError(str(e), param="ttl_seconds") from None
    return ttl_seconds


class Training:
    def __init__(
        self, pool: ModelPool, sessions: Sessions, futures: Futures, checkpoints: CheckpointStore
    ) -> None:
        self.pool, self.sessions, self.futures = pool, sessions, futures
        self.checkpoints = checkpoints

    async def call(self, base: str, call: TrainCall) -> Any:
        """One training call in the engine of `base`; Failed when it did not go through."""
        async with self.pool.use(base) as slot:
            assert slot.served is not None
            answer = await asyncio.wrap_future(slot.served.engine.post(Train(call)))
        if answer.error is not None:
            raise Failed(answer.error, answer.user)
        return answer.value

    def base(self, name: str) -> str:
        """A served model's name, or a 400 naming those served."""
        if name not in self.pool.slots:
            served = ", ".join(f"`{n}`" for n in self.pool.slots)
            raise APIError(
                f"The model `{name}` is not served here; this server trains {served}.",
                param="base_model",
            )
        return name

    # ---- create_model ------------------------------------------------------------------------
    def create_model(self, req: types.CreateModelRequest) -> tuple[str, str]:
        self.sessions.session(req.session_id)
        base = self.base(req.base_model)
        if req.optimizer_config.type != "adamw":
            raise APIError(
                f"the optimizer {req.optimizer_config.type!r} is not available; adamw is",
                param="optimizer_config",
            )
        c = req.lora_config or types.LoraConfig(rank=32)
        if c.rank < 1:
            raise APIError("lora_config.rank must be at least 1", param="lora_config.rank")
        spec = LoraSpec(c.rank, c.seed, c.train_attn, c.train_mlp, c.train_unembed)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"

        async def work() -> Result:
            layers = await self.call(base, CreateRun(model_id, spec))
            self.sessions.models[model_id] = TrainingModel(
                model_id, base, spec, layers, user_metadata=metadata(req.user_metadata)
            )
            return Result({"model_id": model_id, "type": "create_model"})

        return self.futures.start("create_model", work()), model_id

    def info(self, model_id: str) -> dict[str, Any]:
        m = self.sessions.model(model_id)
        slot = self.pool.slots[m.base]
        data = {"arch": None, "model_name": m.base, "tokenizer_id": slot.source or m.base}
        return {"type": "get_info", "model_data": data, "model_id": model_id, "is_lora": True,
                "lora_rank": m.lora.rank, "model_name": m.base}  # fmt: skip

    # ---- forward and forward_backward --------------------------------------------------------
    def forward_backward(self, body: bytes) -> tuple[str, str]:
        req = wire.parse_pass(body)
        m = self.sessions.model(req.model_id)
        try:
            names = losses.needs(req.loss_fn)
        except losses.LossError as e:
            raise APIError(str(e), param="loss_fn") from None
        if not req.data:
            raise APIError("forward_backward needs at least one datum", param="data")
        slot = self.pool.slots[m.base]
        bounds = slot.served.checks.bounds if slot.served is not None else None
        for i, d in enumerate(req.data):
            _check_datum(i, d, names, req.loss_fn, bounds)
        passes = tuple(
            DatumPass(m.model_id, d.tokens, {k: d.inputs[k] for k in names}, req.loss_fn,
                      req.config, not req.forward_only)
            for d in req.data
        )  # fmt: skip
        token_bytes = _token_bytes(bounds) if bounds is not None else 0
        kind = "forward" if req.forward_only else "forward_backward"
        return self.futures.start(kind, self._passes(m, BatchPass(passes, token_bytes))), m.model_id

    async def _passes(self, m: TrainingModel, call: BatchPass) -> Result:
        async with m.lock:
            results: list[DatumResult] = await self.call(m.base, call)
        metrics = {"loss:sum": float(sum(r.loss for r in results))}
        ratios = [r.ratio_deviation for r in results if r.ratio_deviation is not None]
        if ratios:
            metrics["ratio_deviation:max"] = max(ratios)
        return Result(proto=wire.pass_output(results, metrics))

    # ---- optim_step --------------------------------------------------------------------------
    def optim_step(self, req: types.OptimStepRequest) -> tuple[str, str]:
        m = self.sessions.model(req.model_id)
        p = req.optim_params
        if not isinstance(p, types.AdamParams):
            raise APIError("only AdamParams steps are available", param="optim_params")
        adam = AdamSpec(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay,
                        p.grad_clip_norm)  # fmt: skip

        async def work() -> Result:
            async with m.lock:
                metrics = await self.call(m.base, OptimStep(m.model_id, adam))
            return Result({"type": "optim_step", "metrics": metrics})

        return self.futures.start("optim_step", work()), m.model_id

    # ---- save_weights_for_sampler ------------------------------------------------------------
    def save_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> tuple[str, str]:
        m = self.sessions.model(req.model_id)
        ttl = checked_ttl(req.ttl_seconds)
        if req.path is not None:
            if not req.path or "/" in req.path:
                raise APIError("path names the weights: a non-empty name without /",
                               param="path")  # fmt: skip
            adapter = f"{m.model_id}/sampler_weights/{req.path}"
            path: str | None = PREFIX + adapter
        elif req.sampling_session_seq_id is not None:
            adapter, path = f"{m.model_id}/sampler/{req.sampling_session_seq_id}", None
        else:
            raise APIError("give path or sampling_session_seq_id", param="path")

        async def work() -> Result:
            async with m.lock:
                await self.call(m.base, Publish(m.model_id, adapter))
                sampler = self.sessions.add_sampler(m.base, adapter, path, ttl, req.user_metadata)
                if path is None:
                    m.snapshots.append(adapter)
                    while len(m.snapshots) > SNAPSHOTS:
                        await self._unload(m.base, m.snapshots.popleft())
            return Result({"type": "save_weights_for_sampler", "path": path,
                           "sampling_session_id": sampler.sampler_id})  # fmt: skip

        return self.futures.start("save_weights_for_sampler", work()), m.model_id

    # ---- save_weights and load_weights -------------------------------------------------------
    def save(self, req: types.SaveWeightsRequest) -> tuple[str, str]:
        m = self.sessions.model(req.model_id)
        name = req.path or f"checkpoint-{uuid.uuid4().hex[:12]}"
        checked_ttl(req.ttl_seconds)
        try:
            path, directory = self.checkpoints.place(m.model_id, name)
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="path") from None
        if self.checkpoints.exists(directory) and not req.overwrite:
            raise APIError(f"{path} exists; save under another name, or overwrite",
                           param="path")  # fmt: skip

        async def work() -> Result:
            async with m.lock:
                await self.call(m.base, SaveRun(m.model_id, str(directory), m.base))
            self.checkpoints.expire_after(directory, req.ttl_seconds)
            return Result({"type": "save_weights", "path": path})

        return self.futures.start("save_weights", work()), m.model_id

    def load(self, req: types.LoadWeightsRequest) -> tuple[str, str]:
        try:
            directory = self.checkpoints.find(req.path)
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="path") from None
        if req.model_id is not None:  # into a model made by create_model
            m = self.sessions.model(req.model_id)
            model_id, base, create = m.model_id, m.base, False
        elif req.session_id is not None and req.model_seq_id is not None:
            self.sessions.session(req.session_id)
            try:
                base = self.base(req.base_model or checkpoint.base_of(directory))
            except checkpoint.CheckpointError as e:
                raise APIError(str(e), param="path") from None
            model_id, create = f"{req.session_id}:train:{req.model_seq_id}", True
        else:
            raise APIError("give model_id, or session_id and model_seq_id", param="model_id")

        async def work() -> Result:
            if create:
                got = await self.call(base, LoadRun(model_id, str(directory), req.optimizer, True))
                self.sessions.models[model_id] = TrainingModel(
                    model_id, base, got.lora, got.layers, user_metadata=metadata(req.user_metadata)
                )
            else:
                async with m.lock:
                    await self.call(base, LoadRun(model_id, str(directory), req.optimizer, False))
            return Result({"type": "load_weights", "path": req.path, "model_id": model_id})

        return self.futures.start("load_weights", work()), model_id

    async def finish(self, session_id: str) -> None:
        """A finished session's training runs leave their engines with their unnamed
        snapshots; weights saved under a name stay served."""
        for m in self.sessions.finish(session_id):
            async with m.lock:
                while m.snapshots:
                    await self._unload(m.base, m.snapshots.popleft())
                await self.call(m.base, DropRun(m.model_id))

    async def _unload(self, base: str, adapter: str) -> None:
        self.sessions.forget_adapter(adapter)
        async with self.pool.use(base) as slot:
            assert slot.served is not None
            await slot.served.engine.change_adapter(AdapterChange(adapter))


def _token_bytes(bounds: ModelBounds) -> int:
    """What one token of a training forward and backward holds: its logits in float32, their
    log-softmax and its gradient (the most a step holds), and its keys and values."""
    return bounds.vocab_size * 4 * TRAIN_LOGIT_COPIES + bounds.kv_bytes_per_token


def _check_datum(
    i: int, d: wire.Datum, names: tuple[str, ...], loss_fn: str, bounds: ModelBounds | None
) -> None:
    """A 400 for a datum the loss cannot take, or (the model loaded) one longer than its
    context, or whose forward and backward would need more memory than the weights leave."""
    n = len(d.tokens)
    if n == 0:
        raise APIError(f"datum {i}: model_input holds no tokens", param="data")
    if bounds is not None:
        if n > bounds.max_model_len:
            raise APIError(
                f"datum {i}: {n} tokens, more than the model's context of {bounds.max_model_len}",
                param="data",
                code="context_length_exceeded",
            )
        need = n * _token_bytes(bounds)
        if bounds.kv_budget_bytes and need > bounds.kv_budget_bytes:
            raise APIError(
                f"datum {i}: a forward and backward of {n} tokens needs about {need >> 20} MiB,"
                f" more than the {bounds.kv_budget_bytes >> 20} MiB this machine has beside"
                " the model's weights: send shorter datums",
                param="data",
                code="context_length_exceeded",
            )
    for name in names:
        v = d.inputs.get(name)
        if v is None:
            raise APIError(
                f"datum {i}: the {loss_fn} loss needs loss_fn_inputs[{name!r}] (it reads"
                f" {', '.join(names)})",
                param="loss_fn_inputs",
            )
        if v.shape != (n,):
            raise APIError(
                f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(v.shape)}; model_input"
                f" has {n} tokens, so it must be [{n}]",
                param="loss_fn_inputs",
            )
