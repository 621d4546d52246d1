"""Where Tinker's checkpoints live: `tinker://MODEL_ID/weights/NAME` is the directory
`ROOT/MODEL_ID/weights/NAME` (the model id's `:` as `_`) under the server's `--tinker-dir`, in
mlx-lm's adapter format (training/checkpoint.py), so that a server started later on the same
folder loads it again. Only names this server makes and checks resolve (no path from a client
reaches the disk as given). Without a folder: a temporary one, removed when the process ends."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path

from omlx_logprobs.training.checkpoint import CheckpointError

PREFIX = "tinker://"
MODEL_ID = re.compile(r"session-[0-9a-f]+:train:[0-9]+")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class CheckpointStore:
    def __init__(self, root: str | None) -> None:
        self._named = Path(root).expanduser() if root else None
        self._temporary: Path | None = None

    @property
    def root(self) -> Path:
        if self._named is not None:
            return self._named
        if self._temporary is None:  # made at the first save, gone with the process
            self._temporary = Path(tempfile.mkdtemp(prefix="omlx-tinker-"))
            atexit.register(shutil.rmtree, self._temporary, True)
        return self._temporary

    def place(self, model_id: str, name: str) -> tuple[str, Path]:
        """The tinker:// path and the directory of a checkpoint to save."""
        if not NAME.fullmatch(name):
            raise CheckpointError(
                f"{name!r} cannot name a checkpoint: letters, digits, '.', '_' and '-', at most"
                " 128, the first a letter or digit"
            )
        return f"{PREFIX}{model_id}/weights/{name}", self._dir(model_id, name)

    def _dir(self, model_id: str, name: str) -> Path:
        return self.root / model_id.replace(":", "_") / "weights" / name

    def find(self, path: str) -> Path:
        """A saved checkpoint's directory from its tinker:// path."""
        model_id, sep, name = path.removeprefix(PREFIX).partition("/weights/")
        ok = path.startswith(PREFIX) and sep and MODEL_ID.fullmatch(model_id)
        if not (ok and NAME.fullmatch(name)):
            raise CheckpointError(
                f"{path!r} is no checkpoint path (tinker://MODEL_ID/weights/NAME)"
            )
        directory = self._dir(model_id, name)
        if not directory.is_dir():
            raise CheckpointError(f"no checkpoint at {path!r} on this server")
        return directory

    def exists(self, directory: Path) -> bool:
        return directory.exists()
