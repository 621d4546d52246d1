"""The batches of `/v1/batches`: OpenAI's `Batch` objects (openai/types/batch.py), each with the
ids its output and error files will have, kept in memory and written to
`<batch-dir>/batches/<id>/state.json` on every change (a restarted server reads them back)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omlx_logprobs.batchdir.disk import read_json, write_json
from omlx_logprobs.batchdir.files import cursor_page, new_id
from omlx_logprobs.batchdir.journal import Journal

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
WINDOW_S = {"24h": 24 * 3600}  # the completion windows OpenAI takes


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

    def create(
        self, input_file_id: str, endpoint: str, window: str, metadata: dict[str, Any] | None
    ) -> dict[str, Any]:
        now, batch_id = int(time.time()), new_id("batch_")
        batch: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_S[window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
            "model": None,
            "usage": None,
        }
        self.folder(batch_id).mkdir()
        files = [new_id("file-"), new_id("file-")]
        self.states[batch_id] = {"batch": batch, "files": files, "order": time.time_ns()}
        self.save(batch_id)
        return batch

    def get(self, batch_id: str) -> dict[str, Any] | None:
        state = self.states.get(batch_id)
        return None if state is None else dict(state["batch"])

    def batch(self, batch_id: str) -> dict[str, Any]:
        """One known to be here (a run's own)."""
        return dict(self.states[batch_id]["batch"])

    def files(self, batch_id: str) -> tuple[str, str]:
        """The ids its output and error files take once it ends."""
        output, error = self.states[batch_id]["files"]
        return output, error

    def update(self, batch_id: str, **fields: Any) -> None:
        self.states[batch_id]["batch"].update(fields)
        self.save(batch_id)

    def save(self, batch_id: str) -> None:
        write_json(self.folder(batch_id) / "state.json", self.states[batch_id])

    def journal(self, batch_id: str) -> Journal:
        return Journal(self.folder(batch_id))

    def drop_journal(self, batch_id: str) -> None:
        """Once the batch has ended: its results are files of their own by then."""
        (self.folder(batch_id) / "journal").unlink(missing_ok=True)

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
