"""`/v1/files` (upload, list, retrieve, content, delete) and `/v1/batches` (create, retrieve,
list, cancel) in OpenAI's shapes, over the runner (runner.py); behind the API key like every
route."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse

from omlx_logprobs.api.batches.protocol import BatchCreate
from omlx_logprobs.api.batches.runner import BatchRunner
from omlx_logprobs.api.batches.upload import receive_file

UPLOAD_PATH = "/v1/files"  # its body streams past the guard's size limit (api/guard.py)


def add_routes(app: FastAPI, runner: BatchRunner, max_file_bytes: int) -> None:
    files, batches = runner.files, runner.batches

    @app.post(UPLOAD_PATH)
    async def upload_file(raw: Request) -> dict[str, Any]:
        return await receive_file(raw, files, max_file_bytes)

    @app.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        limit: int = Query(10000, ge=1, le=10000),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        return files.listing(purpose, limit, after, order == "asc")

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return runner.file(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        record = runner.file(file_id)
        return FileResponse(files.path(file_id), filename=record["filename"])

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        runner.file(file_id)
        return files.delete(file_id) or {}

    @app.post("/v1/batches")
    async def create_batch(req: BatchCreate) -> dict[str, Any]:
        return runner.create(req)

    @app.get("/v1/batches")
    async def list_batches(
        after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> dict[str, Any]:
        return batches.listing(after, limit)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return runner.batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return runner.cancel(batch_id)
