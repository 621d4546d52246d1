"""Where Tinker's checkpoints live: `tinker://MODEL_ID/KIND/NAME` is the directory
`ROOT/MODEL_ID/KIND/NAME` (the model id's `:` as `_`) under the server's `--tinker-dir`, in
mlx-lm's adapter format (training/checkpoint.py), so that a server started later on the same
folder loads it again. KIND is `weights` (save_state: the weights and Adam's state) or
`external_weights` (save_weights_external: the weights alone). Only names this server makes
and checks resolve (no path from a client reaches the disk as given). Without a folder: a
temporary one, removed when the process ends.

A checkpoint saved with a time to live (`ttl_seconds`) holds its end as a file beside its
weights (EXPIRES, wall-clock seconds): past it, the checkpoint is gone for every lookup and
listing, and its files are removed at the first of them, on this server or a later one on the
same folder."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omlx_logprobs.training.checkpoint import CheckpointError

PREFIX = "tinker://"
MODEL_ID = re.compile(r"session-[0-9a-f]+:train:[0-9]+")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KINDS = ("weights", "external_weights")  # the kinds of checkpoint written as files
EXPIRES = ".expires_at"
# Tinker's bounds on a checkpoint's time to live (the SDK's SaveWeightsRequest): an hour to ten
# years.
TTL_S = (3600, 10 * 365 * 86400)


def check_ttl(ttl_seconds: int | None) -> None:
    """A CheckpointError for a time to live outside Tinker's bounds; None is for ever."""
    if ttl_seconds is not None and not TTL_S[0] <= ttl_seconds <= TTL_S[1]:
        raise CheckpointError(
            f"ttl_seconds is {ttl_seconds}: between {TTL_S[0]} (an hour) and {TTL_S[1]}"
            " (ten years), or none for a checkpoint that stays until deleted"
        )


@dataclass(frozen=True)
class Saved:
    """A checkpoint on disk."""

    model_id: str
    kind: str
    name: str
    directory: Path

    @property
    def path(self) -> str:
        return f"{PREFIX}{self.model_id}/{self.kind}/{self.name}"

    @property
    def time(self) -> float:
        return self.directory.stat().st_mtime

    @property
    def size_bytes(self) -> int:
        files = [f for f in self.directory.iterdir() if f.is_file() and f.name != EXPIRES]
        return sum(f.stat().st_size for f in files)

    @property
    def expires_at(self) -> float | None:
        """Wall-clock seconds past which it is gone; None: it stays until deleted."""
        try:
            return float((self.directory / EXPIRES).read_text())
        except (OSError, ValueError):
            return None


class CheckpointStore:
    def __init__(self, root: str | None, clock: Callable[[], float] = time.time) -> None:
        self._named = Path(root).expanduser() if root else None
        self._temporary: Path | None = None
        self.clock = clock  # wall-clock seconds, for the times to live

    def expire_after(self, directory: Path, ttl_seconds: int | None) -> None:
        """Give a checkpoint just written its end (None: for ever, as a saved-over one's)."""
        (directory / EXPIRES).unlink(missing_ok=True)
        if ttl_seconds is not None:
            (directory / EXPIRES).write_text(repr(self.clock() + ttl_seconds))

    def _live(self, saved: Saved) -> bool:
        """False, the files removed, for a checkpoint past its time to live."""
        end = saved.expires_at
        if end is None or self.clock() < end:
            return True
        shutil.rmtree(saved.directory, ignore_errors=True)
        return False

    @property
    def root(self) -> Path:
        if self._named is not None:
            return self._named
        if self._temporary is None:  # made at the first save, gone with the process
            self._temporary = Path(tempfile.mkdtemp(prefix="omlx-tinker-"))
            atexit.register(shutil.rmtree, self._temporary, True)
        return self._temporary

    def place(self, model_id: str, name: str, kind: str = "weights") -> tuple[str, Path]:
        """The tinker:// path and the directory of a checkpoint to save."""
        if not NAME.fullmatch(name):
            raise CheckpointError(
                f"{name!r} cannot name a checkpoint: letters, digits, '.', '_' and '-', at most"
                " 128, the first a letter or digit"
            )
        return f"{PREFIX}{model_id}/{kind}/{name}", self._dir(model_id, kind, name)

    def _dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.root / model_id.replace(":", "_") / kind / name

    def find(self, path: str, kinds: tuple[str, ...] = ("weights",)) -> Path:
        """A saved checkpoint's directory from its tinker:// path, of one of `kinds`."""
        return self.saved(path, kinds).directory

    def saved(self, path: str, kinds: tuple[str, ...] = KINDS) -> Saved:
        """The checkpoint a tinker:// path names, of one of `kinds`."""
        model_id, kind, name = (path.removeprefix(PREFIX).split("/") + ["", "", ""])[:3]
        ok = path.startswith(PREFIX) and path.count("/") == 4 and kind in kinds
        if not (ok and MODEL_ID.fullmatch(model_id) and NAME.fullmatch(name)):
            shapes = " or ".join(f"tinker://MODEL_ID/{k}/NAME" for k in kinds)
            raise CheckpointError(f"{path!r} is no checkpoint path ({shapes})")
        directory = self._dir(model_id, kind, name)
        if not directory.is_dir():
            raise CheckpointError(f"no checkpoint at {path!r} on this server")
        saved = Saved(model_id, kind, name, directory)
        if not self._live(saved):
            raise CheckpointError(f"the checkpoint at {path!r} has expired (its ttl_seconds)")
        return saved

    def exists(self, directory: Path) -> bool:
        """Whether a checkpoint's directory holds one (an expired one goes, and does not)."""
        return directory.exists() and self._live(Saved("", "", directory.name, directory))

    def listing(self, model_id: str | None = None) -> list[Saved]:
        """The checkpoints on disk, oldest first: one training run's, or all."""
        if (self._named is None and self._temporary is None) or not self.root.is_dir():
            return []  # nothing saved yet
        runs = [self.root / model_id.replace(":", "_")] if model_id else self.root.iterdir()
        found = []
        for run in runs:
            run_id = run.name.replace("_train_", ":train:")
            if not MODEL_ID.fullmatch(run_id):
                continue
            for kind in KINDS:
                if (run / kind).is_dir():
                    found += [Saved(run_id, kind, d.name, d) for d in (run / kind).iterdir()
                              if d.is_dir() and NAME.fullmatch(d.name)]  # fmt: skip
        return sorted(filter(self._live, found), key=lambda s: (s.time, s.path))

    def remove(self, saved: Saved) -> None:
        shutil.rmtree(saved.directory)

    def copy(self, saved: Saved, model_id: str, ttl_seconds: int | None = None) -> Saved:
        """A copy of a checkpoint under another training run, the same kind and name, with a
        time to live of its own (not the original's)."""
        path, directory = self.place(model_id, saved.name, saved.kind)
        if directory.exists():
            raise CheckpointError(f"{path} exists")
        shutil.copytree(saved.directory, directory)
        self.expire_after(directory, ttl_seconds)
        return Saved(model_id, saved.kind, saved.name, directory)
