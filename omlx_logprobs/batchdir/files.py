"""The files of `/v1/files`: OpenAI's `FileObject` records and their content, one pair per
file under `<batch-dir>/files/` (`<id>` the bytes, `<id>.json` the record), kept in memory
after the start (a list is a sort of the records, never a scan of the disk). A path is made
only from an id this store made (`new_id`), and looked up only for an id it holds."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import IO, Any

from omlx_logprobs.batchdir.disk import read_json, write_json

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

    def get(self, file_id: str) -> dict[str, Any] | None:
        return self.records.get(file_id)

    def save(self, content: IO[bytes], filename: str, purpose: str) -> dict[str, Any]:
        """A new file of `content`'s bytes (read from its start)."""
        file_id = new_id("file-")
        content.seek(0)
        with open(self.path(file_id), "wb") as out:
            shutil.copyfileobj(content, out, 1 << 20)
        return self.add(file_id, filename, purpose)

    def adopt(self, file_id: str, source: Path, filename: str, purpose: str) -> str | None:
        """The file at `source` moved in as `file_id` (None when it is empty or missing); an
        id already held is kept as it is (a second call after a restart)."""
        if file_id in self.records:
            return file_id
        if not source.exists() or source.stat().st_size == 0:
            return None
        os.replace(source, self.path(file_id))
        self.add(file_id, filename, purpose)
        return file_id

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

    def delete(self, file_id: str) -> dict[str, Any] | None:
        if file_id not in self.records:
            return None
        del self.records[file_id], self.order[file_id]
        for path in (self.dir / f"{file_id}.json", self.path(file_id)):
            path.unlink(missing_ok=True)
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
