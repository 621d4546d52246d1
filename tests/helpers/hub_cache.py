"""huggingface_hub's cache layout, built by tests: models--ORG--NAME/blobs/<sha256> holding the
files, snapshots/<revision>/<file> links to them, refs/main naming the revision."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def write_cached_repo(
    cache: Path, repo_id: str, source: Path, revision: str = REVISION, only: list[str] | None = None
) -> Path:
    """Put the files of `source` (or those named in `only`) into the cache as `repo_id` at
    `revision`; returns the snapshot directory."""
    folder = repo_folder(cache, repo_id)
    blobs, snapshot = folder / "blobs", folder / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if not f.is_file() or (only is not None and f.name not in only):
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot
