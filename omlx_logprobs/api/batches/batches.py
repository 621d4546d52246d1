"""The batches of `/v1/batches`: OpenAI's `Batch` objects (openai/types/batch.py), each with the
ids its output and error files will have, kept in memory and written to
`<batch-dir>/batches/<id>/state.json` on every change (a restarted server reads them back)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omlx_logprobs.api.batches.disk import read_json, write_json
from omlx_logprobs.api.batches.files import cursor_page, new_id
from omlx_logprobs.api.core.errors import APIError

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
WINDOW_S = {"24h": 24 * 3600}  # the completion windows OpenAI takes


class BatchCreate(BaseModel):
    """`POST /v1/batches` (openai/types/batch_create_params.py)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    # 16 pairs at most, keys of 64 characters and values of 512 at most (OpenAI's bounds).
    metadata: dict[str, Any] | None = Field(None, max_length=16)
    # Accepted: the files this server writes are kept until deleted.
    output_expires_after: dict[str, Any] | None = None


def check_metadata(metadata: dict[str, Any] | None) -> None:
    for key, value in (metadata or {}).items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise APIError(
                "metadata holds strings: keys of 64 characters at most, values of 512.",
                "metadata",
            )


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        # id -> {"batch": the Batch object, "files": [output id, error id], "order": its
        # creation in nanoseconds (lists keep it within a second)}
        self.states: dict[str, dict[str, Any]] = {}
        for path in self.dir.glob("batch_*/state.json"):
            state = read_json(path)
            if isinstance(state, dict) and "batch" in state:
                self.states[state["batch"]["id"]] = state

    def folder(self, batch_id: str) -> Path:
        return self.dir / batch_id

    def create(self, req: BatchCreate) -> dict[str, Any]:
        now, batch_id = int(time.time()), new_id("batch_")
        batch: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": req.endpoint,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_S[req.completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": req.metadata,
            "model": None,
            "usage": None,
        }
        self.folder(batch_id).mkdir()
        files = [new_id("file-"), new_id("file-")]
        self.states[batch_id] = {"batch": batch, "files": files, "order": time.time_ns()}
        self.save(batch_id)
        return batch

    def get(self, batch_id: str) -> dict[str, Any]:
        state = self.states.get(batch_id)
        if state is None:
            raise APIError(f"No batch found with id '{batch_id}'.", "batch_id", 404, "not_found")
        return dict(state["batch"])

    def files(self, batch_id: str) -> tuple[str, str]:
        """The ids its output and error files take once it ends."""
        output, error = self.states[batch_id]["files"]
        return output, error

    def update(self, batch_id: str, **fields: Any) -> None:
        self.states[batch_id]["batch"].update(fields)
        self.save(batch_id)

    def save(self, batch_id: str) -> None:
        write_json(self.folder(batch_id) / "state.json", self.states[batch_id])

    def listing(self, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first, the batches after `after`."""
        states = sorted(self.states.values(), key=lambda s: int(s["order"]), reverse=True)
        batches = [s["batch"] for s in states]
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        return cursor_page([dict(b) for b in batches], limit)

    def unfinished(self) -> list[str]:
        return [i for i, s in self.states.items() if s["batch"]["status"] not in TERMINAL]
