"""Hugging Face Hub names (`--model org/name`): the local Hugging Face cache first, then a
download through `huggingface_hub` unless downloads are off (`--offline`, `HF_HUB_OFFLINE=1`).

The cache is huggingface_hub's own layout (`models--org--name/{refs,snapshots,blobs}`), found
through `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, read when a model
is resolved (not when huggingface_hub was imported).
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("omlx_logprobs")

# What serving an mlx-lm directory needs: config, weights, tokenizer and chat template files.
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = ("1", "true", "yes", "on")


def is_hub_name(model: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def downloads_off(offline: bool) -> bool:
    return offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_hub_model(repo_id: str, offline: bool = False) -> Path:
    """The snapshot directory of `repo_id`: from the cache, else downloaded into it.

    Raises FileNotFoundError naming the repository when it is not cached and downloads are off,
    when the download fails, or when the repository holds no mlx-lm model.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir()
    try:
        path = Path(
            snapshot_download(
                repo_id, cache_dir=cache, local_files_only=True, allow_patterns=PATTERNS
            )
        )
        if _complete(path):
            log.info("model %s from the Hugging Face cache: %s", repo_id, path)
            return path
        missing = "is only partly in"
    except LocalEntryNotFoundError:
        missing = "is not in"
    if downloads_off(offline):
        raise FileNotFoundError(
            f"--model {repo_id}: the Hugging Face repository {repo_id} {missing} the cache"
            f" ({cache}) and downloads are off (--offline or HF_HUB_OFFLINE=1); download it"
            f" once while online (`hf download {repo_id}`) or serve without --offline"
        )
    log.info("downloading %s from the Hugging Face Hub into %s", repo_id, cache)
    path = Path(download(repo_id, cache))
    if not _complete(path):
        raise FileNotFoundError(
            f"--model {repo_id}: the repository has no config.json and .safetensors weights, so"
            " it is not an mlx-lm model (for a GGUF repository, download its .gguf file and"
            " pass that file's path)"
        )
    log.info("model %s downloaded: %s", repo_id, path)
    return path


def download(repo_id: str, cache: Path) -> str:
    """huggingface_hub's snapshot download, its progress in our log."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        return snapshot_download(
            repo_id, cache_dir=cache, allow_patterns=PATTERNS, tqdm_class=LogProgress
        )
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"--model {repo_id}: no such Hugging Face repository, or it needs a token"
            " (`hf auth login` or HF_TOKEN)"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise FileNotFoundError(f"--model {repo_id}: the download failed: {e}") from e


def _tqdm() -> Any:
    from huggingface_hub.utils import tqdm

    return tqdm


class LogProgress(_tqdm()):  # type: ignore[misc]
    """A progress bar that writes a log line every few seconds instead of drawing."""

    interval_s = 5.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["file"] = io.StringIO()
        kwargs["disable"] = False
        super().__init__(*args, **kwargs)
        self._logged = 0.0

    def display(self, msg: str | None = None, pos: int | None = None) -> None:
        now = time.monotonic()
        done = self.total is not None and self.total > 0 and self.n >= self.total
        if self.n and (done or now - self._logged >= self.interval_s):
            self._logged = now
            log.info("download: %s", self.format_meter(**self.format_dict))
