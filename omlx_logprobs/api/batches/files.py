"""The files of `/v1/files`: OpenAI's `FileObject` records and their content, one pair per
file under `<batch-dir>/files/` (`<id>` the bytes, `<id>.json` the record), kept in memory
after the start (a list is a sort of the records, never a scan of the disk)."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from omlx_logprobs.api.batches.disk import read_json, write_json
from omlx_logprobs.api.core.errors import APIError

# OpenAI's purposes (openai/types/file_object.py); `batch` is the one a batch reads.
PURPOSES = frozenset(
    {
        "assistants",
        "assistants_output",
        "batch",
        "batch_output",
        "fine-tune",
        "fine-tune-results",
        "vision",
        "user_data",
    }
)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class FileStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict[str, Any]] = {}
        self.order: dict[str, int] = {}  # creation in nanoseconds: lists keep it within a second
        for meta in self.dir.glob("file-*.json"):
            saved = read_json(meta)
            if isinstance(saved, dict) and self.path(saved["file"]["id"]).exists():
                self.records[saved["file"]["id"]] = saved["file"]
                self.order[saved["file"]["id"]] = saved["order"]

    def path(self, file_id: str) -> Path:
        return self.dir / file_id

    def add(self, file_id: str, filename: str, purpose: str) -> dict[str, Any]:
        """The record of the content already at path(file_id), written beside it."""
        record = {
            "id": file_id,
            "object": "file",
            "bytes": self.path(file_id).stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        order = time.time_ns()
        write_json(self.dir / f"{file_id}.json", {"file": record, "order": order})
        self.records[file_id], self.order[file_id] = record, order
        return record

    def get(self, file_id: str) -> dict[str, Any]:
        record = self.records.get(file_id)
        if record is None:
            raise APIError(f"No such File object: {file_id}", "file_id", 404, "file_not_found")
        return record

    def listing(
        self, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> dict[str, Any]:
        """OpenAI's cursor page: newest first unless `ascending`, the records after `after`."""
        records = sorted(
            (r for r in self.records.values() if purpose is None or r["purpose"] == purpose),
            key=lambda r: self.order[r["id"]],
            reverse=not ascending,
        )
        if after is not None:
            ids = [r["id"] for r in records]
            records = records[ids.index(after) + 1 :] if after in ids else []
        return cursor_page(records, limit)

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        del self.records[file_id], self.order[file_id]
        for path in (self.dir / f"{file_id}.json", self.path(file_id)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        return {"id": file_id, "object": "file", "deleted": True}


def cursor_page(records: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list object: `data`, the first and last ids and whether more follow."""
    page = records[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(records) > limit,
    }
