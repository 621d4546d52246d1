"""The batch directory's small JSON records, written whole through a temporary file and a
rename, so a crash leaves the old record or the new one, never half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """The record, or None when it is missing or unreadable (a record is skipped, not fatal)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
