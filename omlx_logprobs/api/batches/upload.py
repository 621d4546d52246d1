"""`POST /v1/files`: a multipart upload (`file` and `purpose`, as the `openai` SDK sends it) read
as it arrives, never whole in memory (parts beyond a megabyte spool to a temporary file), and
refused with a 400 once it passes the file size limit, declared or counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.batchdir.files import PURPOSES, FileStore

FORM_SLACK = 64 << 10  # the multipart framing and the `purpose` field around the file's bytes


def too_large(limit: int) -> APIError:
    return APIError(
        f"The file exceeds the server's limit of {limit} bytes.", "file", 400, "file_too_large"
    )


async def receive_file(request: Request, store: FileStore, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + FORM_SLACK:
        raise too_large(limit)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError("Upload the file as multipart/form-data with `file` and `purpose`.")

    async def counted() -> AsyncGenerator[bytes, None]:
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit + FORM_SLACK:
                raise too_large(limit)
            yield chunk

    try:
        form = await MultiPartParser(request.headers, counted(), max_files=1, max_fields=8).parse()
    except MultiPartException as e:
        raise APIError(f"The upload is not a valid multipart form: {e.message}") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str) or purpose not in PURPOSES:
            raise APIError(f"purpose must be one of {', '.join(sorted(PURPOSES))}.", "purpose")
        if not isinstance(upload, UploadFile):
            raise APIError("The form has no `file` part.", "file")
        if (upload.size or 0) > limit:
            raise too_large(limit)
        name = upload.filename or "upload.jsonl"
        return await asyncio.to_thread(store.save, upload.file, name, purpose)
    finally:
        await form.close()
