"""Tinker's checkpoints beyond save_state: `save_weights_external` (the weights alone, in
mlx-lm's adapter format, at `tinker://MODEL_ID/external_weights/NAME`), `copy_weights` (a
checkpoint's files under another training run), and the REST client's listings: the training
runs (`GET training_runs`, `training_runs/{id}`), a run's checkpoints and everyone's
(`training_runs/{id}/checkpoints`, `checkpoints`), deleting one, and an external one's files
(`external_weights_urls`: file:// URLs on the server's own disk), and what a checkpoint is
trained on (`weights_info`).

A training run is listed while its model lives (create_model, until its session finishes) or
while checkpoints of it are on disk (under `--tinker-dir`, across restarts). Checkpoints are
files (training/store.py) but for named sampler weights, which are served, not written: they
are listed while served and go with their session. A checkpoint saved or copied with
`ttl_seconds` is listed with its `expires_at` and gone past it (training/store.py); named
sampler weights with one are listed and found by their path until then."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from tinker import types

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.tinker.futures import Futures, Result
from omlx_logprobs.api.tinker.sessions import Sessions
from omlx_logprobs.api.tinker.training import Training, checked_ttl
from omlx_logprobs.training import checkpoint
from omlx_logprobs.training.calls import SaveRun
from omlx_logprobs.training.store import PREFIX, Saved

API = "/api/v1"
T = TypeVar("T")
TYPES = {"weights": "training", "external_weights": "external", "sampler_weights": "sampler"}


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def _until(seconds: float | None) -> str | None:
    return None if seconds is None else _when(seconds)


def page_of(items: list[T], limit: int, offset: int) -> tuple[list[T], dict[str, int]]:
    if limit < 1 or offset < 0:
        raise APIError("limit must be at least 1 and offset at least 0", param="limit")
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return items[offset : offset + limit], cursor


class Checkpoints:
    def __init__(self, training: Training, sessions: Sessions, futures: Futures) -> None:
        self.training, self.sessions, self.futures = training, sessions, futures
        self.store = training.checkpoints

    # ---- save_weights_external and copy_weights ----------------------------------------------
    def save_external(self, req: types.SaveWeightsExternalRequest) -> tuple[str, str]:
        m = self.sessions.model(req.model_id)
        ttl = checked_ttl(req.ttl_seconds)
        if req.age_encryption_recipients:
            raise APIError("encrypted exports are not available here",
                           param="age_encryption_recipients")  # fmt: skip
        try:
            path, directory = self.store.place(m.model_id, req.path, "external_weights")
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="path") from None
        if self.store.exists(directory):
            raise APIError(f"{path} exists; save under another name", param="path")

        async def work() -> Result:
            async with m.lock:
                await self.training.call(
                    m.base, SaveRun(m.model_id, str(directory), m.base, optimizer=False)
                )
            self.store.expire_after(directory, ttl)
            size = self.store.saved(path).size_bytes
            return Result({"type": "save_weights_external", "path": path, "size_bytes": size})

        return self.futures.start("save_weights_external", work()), m.model_id

    async def copy(self, req: types.CopyWeightsRequest) -> dict[str, str]:
        """A checkpoint's files under the training run a session's slot names, or (a project
        given) under a run of their own that nothing trains."""
        ttl = checked_ttl(req.ttl_seconds)
        try:
            saved = self.store.saved(req.source_path)
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="source_path") from None
        if req.session_id is not None and req.model_seq_id is not None:
            self.sessions.session(req.session_id)
            run = f"{req.session_id}:train:{req.model_seq_id}"
        elif req.destination_project_id is not None:
            run = f"session-{uuid.uuid4().hex[:16]}:train:0"
        else:
            raise APIError("give session_id and model_seq_id, or destination_project_id",
                           param="session_id")  # fmt: skip
        try:
            copied = await asyncio.to_thread(self.store.copy, saved, run, ttl)
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="source_path") from None
        return {"tinker_path": copied.path}

    # ---- the listings ------------------------------------------------------------------------
    def _file(self, s: Saved) -> dict[str, Any]:
        return {"checkpoint_id": f"{s.kind}/{s.name}", "checkpoint_type": TYPES[s.kind],
                "time": _when(s.time), "tinker_path": s.path, "size_bytes": s.size_bytes,
                "public": False, "expires_at": _until(s.expires_at)}  # fmt: skip

    def _served(self, run_id: str | None) -> list[dict[str, Any]]:
        """Named sampler weights, served (not files), of one run or of all."""
        found = []
        for path, s in self.sessions.live_paths().items():
            run, _, name = path.removeprefix(PREFIX).partition("/sampler_weights/")
            if name and run_id in (None, run):
                found.append({"checkpoint_id": f"sampler_weights/{name}",
                              "checkpoint_type": "sampler", "time": _when(s.created),
                              "tinker_path": path, "size_bytes": None, "public": False,
                              "expires_at": _until(s.expires_at),
                              "user_metadata": s.user_metadata})  # fmt: skip
        return found

    def _checkpoints(self, run_id: str | None) -> list[dict[str, Any]]:
        """Oldest first."""
        files = [self._file(s) for s in self.store.listing(run_id)]
        return sorted(files + self._served(run_id), key=lambda c: (c["time"], c["tinker_path"]))

    def checkpoints(self, run_id: str) -> dict[str, Any]:
        self.run(run_id)  # a 404 for a run that is not here
        return {"checkpoints": self._checkpoints(run_id), "cursor": None}

    def all_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        page, cursor = page_of(self._checkpoints(None)[::-1], limit, offset)  # newest first
        return {"checkpoints": page, "cursor": cursor}

    def run(self, run_id: str) -> dict[str, Any]:
        live = self.sessions.models.get(run_id)
        saved = self.store.listing(run_id)
        if live is None and not saved:
            raise APIError(f"no training run {run_id!r}", param="training_run_id", status=404)
        meta = None
        if live is not None:
            base, rank, last, meta = live.base, live.lora.rank, live.created, live.user_metadata
        else:
            try:
                d = saved[-1].directory
                base, rank = checkpoint.base_of(d), checkpoint.spec_of(d).rank
            except checkpoint.CheckpointError:  # written by another program
                base, rank = "", None
            last = 0.0
        listed = self._checkpoints(run_id)
        files = [c for c in listed if c["checkpoint_type"] == "training"]
        samplers = [c for c in listed if c["checkpoint_type"] == "sampler"]
        times = [s.time for s in saved]
        return {"training_run_id": run_id, "base_model": base, "model_owner": "local",
                "is_lora": True, "corrupted": False, "lora_rank": rank,
                "last_request_time": _when(max([last, *times])),
                "last_checkpoint": files[-1] if files else None,
                "last_sampler_checkpoint": samplers[-1] if samplers else None,
                "user_metadata": meta}  # fmt: skip

    def runs(self, limit: int, offset: int) -> dict[str, Any]:
        ids = set(self.sessions.models) | {s.model_id for s in self.store.listing()}
        page, cursor = page_of(sorted(ids), limit, offset)
        return {"training_runs": [self.run(i) for i in page], "cursor": cursor}

    def weights_info(self, path: str) -> dict[str, Any]:
        """What a checkpoint is trained on: a file's config, or a served sampler's model."""
        if (served := self.sessions.live_paths().get(path)) is not None:
            run = self.sessions.models.get(path.removeprefix(PREFIX).split("/")[0])
            spec = run.lora if run is not None else None
            base = served.base
        else:
            try:
                d = self.store.saved(path).directory
                base, spec = checkpoint.base_of(d), checkpoint.spec_of(d)
            except checkpoint.CheckpointError as e:
                raise APIError(str(e), param="tinker_path") from None
        info: dict[str, Any] = {"base_model": base, "is_lora": True}
        if spec is not None:
            info |= {"lora_rank": spec.rank, "train_attn": spec.attn, "train_mlp": spec.mlp,
                     "train_unembed": spec.unembed}  # fmt: skip
        return info

    def delete(self, run_id: str, checkpoint_id: str) -> None:
        path = f"{PREFIX}{run_id}/{checkpoint_id}"
        if checkpoint_id.startswith("sampler_weights/"):
            raise APIError("sampler weights are served, not files: they go with their session",
                           param="checkpoint_id")  # fmt: skip
        try:
            self.store.remove(self.store.saved(path))
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="checkpoint_id", status=404) from None

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """The REST client's set_checkpoint_ttl: a new end from now, or none."""
        checked_ttl(ttl_seconds)
        path = f"{PREFIX}{run_id}/{checkpoint_id}"
        if checkpoint_id.startswith("sampler_weights/"):
            self.sessions.set_ttl(path, ttl_seconds)
            return
        try:
            self.store.expire_after(self.store.saved(path).directory, ttl_seconds)
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="checkpoint_id", status=404) from None

    def urls(self, run_id: str, checkpoint_id: str) -> dict[str, Any]:
        try:
            saved = self.store.saved(f"{PREFIX}{run_id}/{checkpoint_id}", ("external_weights",))
        except checkpoint.CheckpointError as e:
            raise APIError(str(e), param="checkpoint_id", status=404) from None
        files = sorted(f for f in saved.directory.iterdir() if f.is_file())
        return {"urls": {f.name: f.resolve().as_uri() for f in files},
                "expires": _when(saved.time + 10 * 365 * 86400)}  # fmt: skip


def add_listing_routes(app: FastAPI, checkpoints: Checkpoints) -> None:
    """The REST client's GET and DELETE routes (a checkpoint id holds a `/`: KIND/NAME)."""

    @app.get(f"{API}/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return checkpoints.runs(limit, offset)

    @app.get(API + "/training_runs/{run_id}")
    async def training_run(run_id: str) -> dict[str, Any]:
        return checkpoints.run(run_id)

    @app.get(API + "/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str) -> dict[str, Any]:
        return checkpoints.checkpoints(run_id)

    @app.get(API + "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        return checkpoints.urls(run_id, checkpoint_id)

    @app.put(API + "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def checkpoint_ttl(run_id: str, checkpoint_id: str, raw: Request) -> None:
        try:
            ttl = (await raw.json())["ttl_seconds"]
        except (ValueError, KeyError, TypeError):
            raise APIError('the body is {"ttl_seconds": SECONDS or null}',
                           param="ttl_seconds") from None  # fmt: skip
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)):
            raise APIError("ttl_seconds is a whole number of seconds, or null", param="ttl_seconds")
        checkpoints.set_ttl(run_id, checkpoint_id, ttl)

    @app.delete(API + "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> None:
        checkpoints.delete(run_id, checkpoint_id)

    @app.post(f"{API}/weights_info")
    async def weights_info(raw: Request) -> dict[str, Any]:
        try:
            path = (await raw.json())["tinker_path"]
        except (ValueError, KeyError, TypeError):
            raise APIError('the body is {"tinker_path": PATH}', param="tinker_path") from None
        if not isinstance(path, str):
            raise APIError("tinker_path is a string", param="tinker_path")
        return checkpoints.weights_info(path)

    @app.get(f"{API}/checkpoints")
    async def all_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return checkpoints.all_checkpoints(limit, offset)
