"""Every batch of the server: created (checked first: a 400 for an endpoint this server does
not serve, an unknown input file, a window other than OpenAI's), run as a task of the server's
event loop, cancelled, and at the start the unfinished ones resumed; at shutdown the runs stop
with their written lines kept."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from omlx_logprobs.api.batches.dispatch import targets
from omlx_logprobs.api.batches.protocol import BatchCreate, check_metadata
from omlx_logprobs.api.batches.worker import BatchRun, Context
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.batchdir.batches import TERMINAL, WINDOW_S, BatchStore
from omlx_logprobs.batchdir.files import FileStore
from omlx_logprobs.batchdir.root import close_root, open_root

log = logging.getLogger("omlx_logprobs")


class BatchRunner:
    def __init__(self, folder: str | None, concurrency: int, closing: Callable[[], bool]) -> None:
        """`folder`: --batch-dir; None, a temporary one removed by close()."""
        self.folder, self.root = folder, open_root(folder)
        self.files, self.batches = FileStore(self.root), BatchStore(self.root)
        self.concurrency, self.closing = concurrency, closing
        self.ctx: Context | None = None
        self.runs: dict[str, tuple[BatchRun, asyncio.Task[None]]] = {}

    def start(self, app: FastAPI) -> None:
        """In the server's event loop, once every route is in: the unfinished batches go on."""
        room = asyncio.Semaphore(self.concurrency)
        self.ctx = Context(self.batches, self.files, targets(app), room, self.closing)
        unfinished = self.batches.unfinished()
        if unfinished:
            log.info("batches resumed from %s: %s", self.root, ", ".join(unfinished))
        for batch_id in unfinished:
            self.launch(batch_id)

    def launch(self, batch_id: str) -> None:
        assert self.ctx is not None
        run = BatchRun(batch_id, self.ctx)
        task = asyncio.create_task(run.run(), name=f"batch {batch_id}")
        self.runs[batch_id] = (run, task)
        task.add_done_callback(lambda _: self.runs.pop(batch_id, None))

    def create(self, req: BatchCreate) -> dict[str, Any]:
        assert self.ctx is not None
        if req.endpoint not in self.ctx.targets:
            served = ", ".join(sorted(self.ctx.targets))
            message = f"This server runs batches for {served}, not {req.endpoint}."
            raise APIError(message, "endpoint", code="unsupported_endpoint")
        if req.completion_window not in WINDOW_S:
            raise APIError("completion_window must be 24h.", "completion_window")
        check_metadata(req.metadata)
        record = self.files.records.get(req.input_file_id)
        if record is None:
            raise APIError(f"No such File object: {req.input_file_id}", "input_file_id")
        if record["purpose"] != "batch":
            raise APIError("The input file must be uploaded with purpose batch.", "input_file_id")
        batch = self.batches.create(
            req.input_file_id, req.endpoint, req.completion_window, req.metadata
        )
        self.launch(batch["id"])
        return batch

    def file(self, file_id: str) -> dict[str, Any]:
        record = self.files.get(file_id)
        if record is None:
            raise APIError(f"No such File object: {file_id}", "file_id", 404, "file_not_found")
        return record

    def batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise APIError(f"No batch found with id '{batch_id}'.", "batch_id", 404, "not_found")
        return batch

    def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = self.batch(batch_id)
        if batch["status"] in TERMINAL or batch["status"] == "finalizing":
            message = f"A batch that is {batch['status']} cannot be cancelled."
            raise APIError(message, "batch_id", 409, "batch_not_cancellable")
        if batch["status"] != "cancelling":
            self.batches.update(batch_id, status="cancelling", cancelling_at=int(time.time()))
        if batch_id in self.runs:
            self.runs[batch_id][0].halt("cancel")
        else:
            self.launch(batch_id)  # not running: it ends as cancelled at once
        return self.batch(batch_id)

    async def stop(self) -> None:
        """The runs stopped (their lines in flight aborted, not written) and awaited."""
        for run, _ in self.runs.values():
            run.halt("shutdown")
        tasks = [task for _, task in self.runs.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    def close(self) -> None:
        close_root(self.root, self.folder)
