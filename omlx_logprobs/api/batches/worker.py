"""One batch run: its input read line by line from disk, its lines through their route
(dispatch.py) while the server's room for batch lines allows (--batch-concurrency, every batch's
lines together), each result appended as it finishes (journal.py), the
counts saved as they change; then its output and error files made `/v1/files` files. A stop
ends it early: a cancel (the lines in flight aborted, the batch `cancelled` with what was
written), the completion window passed (`expired`), or the server shutting down (the batch
left as it is, to go on after the restart from the lines not yet written)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omlx_logprobs.api.batches.dispatch import Target, call
from omlx_logprobs.batchdir import lines
from omlx_logprobs.batchdir.batches import BatchStore
from omlx_logprobs.batchdir.files import FileStore, new_id
from omlx_logprobs.batchdir.journal import Journal
from omlx_logprobs.batchdir.usage import NONE, batch_usage, tokens

log = logging.getLogger("omlx_logprobs")


@dataclass(frozen=True)
class Context:
    """What every run shares."""

    batches: BatchStore
    files: FileStore
    targets: dict[str, Target]
    room: asyncio.Semaphore  # lines in flight, of every batch together (--batch-concurrency)
    closing: Callable[[], bool]  # the server is shutting down


class BatchRun:
    def __init__(self, batch_id: str, ctx: Context) -> None:
        self.id, self.ctx = batch_id, ctx
        self.stop = asyncio.Event()  # the lines in flight see a disconnect once set
        self.reason: str | None = None  # "cancel", "expired" or "shutdown", once stopped

    def halt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.stop.set()

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as e:  # never silent: the batch fails with the reason
            log.exception("batch %s failed", self.id)
            self.fail("server_error", f"The batch failed: {type(e).__name__}: {e}")

    async def _run(self) -> None:
        store, batch = self.ctx.batches, self.ctx.batches.batch(self.id)
        if batch["status"] == "cancelling":  # cancelled while the server was down
            self.halt("cancel")
            return self.finish(store.journal(self.id))
        source = self.ctx.files.path(batch["input_file_id"])
        target = self.ctx.targets.get(batch["endpoint"])
        if not source.exists() or target is None:
            return self.fail("invalid_file", "The input file or the endpoint is gone.")
        scan = await asyncio.to_thread(lines.scan, source)
        if scan.total == 0:
            return self.fail("empty_file", "The input file has no requests.")
        if self.reason is None and store.batch(self.id)["status"] == "validating":
            counts = {"total": scan.total, "completed": 0, "failed": 0}
            store.update(self.id, status="in_progress", in_progress_at=now(), request_counts=counts)
        journal = store.journal(self.id)
        try:
            await self.feed(batch, scan, target, journal)
        finally:
            journal.close()
        self.finish(journal)

    async def feed(
        self, batch: dict[str, Any], scan: lines.Scan, target: Target, journal: Journal
    ) -> None:
        room = self.ctx.room
        running: set[asyncio.Task[None]] = set()

        def done(task: asyncio.Task[None]) -> None:
            running.discard(task)
            room.release()

        source = self.ctx.files.path(batch["input_file_id"])
        reading = lines.numbered(source)
        for number, raw in reading:
            if number in journal.done:
                continue
            await room.acquire()
            if time.time() > batch["expires_at"]:
                self.halt("expired")
            if self.ctx.closing():
                self.halt("shutdown")
            if self.reason is not None:
                room.release()
                reading.close()  # the input file closed now, not when collected
                break
            line = lines.check(number, raw, batch["endpoint"], scan.repeats)
            task = asyncio.create_task(self.one(line, target, journal))
            running.add(task)
            task.add_done_callback(done)
        # Every line ended before the journal closes; then the first failure (a full disk) fails
        # the batch.
        for outcome in await asyncio.gather(*running, return_exceptions=True):
            if isinstance(outcome, Exception):
                raise outcome

    async def one(self, line: lines.Line, target: Target, journal: Journal) -> None:
        record: dict[str, Any] = {"id": new_id("batch_req_"), "custom_id": line.custom_id}
        used, model = NONE, None
        if line.body is None:
            error = {"code": line.code, "message": line.message, "line": line.number}
            record.update(response=None, error=error)
            ok = False
        else:
            status, body = await call(target, line.body, self.stop)
            # Not written, so it runs again: aborted by a stop, or failed by the shutdown.
            if status == 499 or (status >= 500 and (self.reason or self.ctx.closing())):
                return
            request_id = body.get("id") if isinstance(body, dict) else None
            response = {
                "status_code": status,
                "request_id": request_id if isinstance(request_id, str) else new_id("req_"),
                "body": body,
            }
            record.update(response=response, error=None)
            ok = 200 <= status < 300
            used = tokens(body)
            model = line.body.get("model")
        journal.write(line.number, ok, json.dumps(record).encode(), used)
        batch = self.ctx.batches.batch(self.id)
        counts = {**batch["request_counts"], "completed": journal.completed}
        counts["failed"] = journal.failed
        fields: dict[str, Any] = {"request_counts": counts, "usage": batch_usage(journal.tokens)}
        if batch.get("model") is None and isinstance(model, str):
            fields["model"] = model  # the first line's, as OpenAI names one model per batch
        self.ctx.batches.update(self.id, **fields)

    def finish(self, journal: Journal) -> None:
        store = self.ctx.batches
        if self.reason == "shutdown":
            return  # resumed at the next start
        if self.reason is None:
            store.update(self.id, status="finalizing", finalizing_at=now())
        output_id, error_id = store.files(self.id)
        files = self.ctx.files  # each None when it holds no line
        fields = {
            "output_file_id": files.adopt(
                output_id, journal.output_path, f"{self.id}_output.jsonl", "batch_output"
            ),
            "error_file_id": files.adopt(
                error_id, journal.error_path, f"{self.id}_error.jsonl", "batch_output"
            ),
        }
        if self.reason == "cancel":
            store.update(self.id, status="cancelled", cancelled_at=now(), **fields)
        elif self.reason == "expired":
            store.update(self.id, status="expired", expired_at=now(), **fields)
        else:
            store.update(self.id, status="completed", completed_at=now(), **fields)
        store.drop_journal(self.id)

    def fail(self, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": None, "line": None}
        errors = {"object": "list", "data": [error]}
        self.ctx.batches.update(self.id, status="failed", failed_at=now(), errors=errors)


def now() -> int:
    return int(time.time())
