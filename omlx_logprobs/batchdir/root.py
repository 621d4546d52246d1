"""The batch directory itself: the one the operator named, made if need be, or else a new
temporary one that this process removes when it stops (nothing would resume from it)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def open_root(named: str | None) -> Path:
    root = Path(named).expanduser() if named else Path(tempfile.mkdtemp(prefix="omlx-batches-"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def close_root(root: Path, named: str | None) -> None:
    if not named:
        shutil.rmtree(root, ignore_errors=True)
