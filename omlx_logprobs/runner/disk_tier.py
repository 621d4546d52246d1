"""The prefix cache's disk tier (`--kv-cache-dir`): the base model's kept sequences that the
memory budget evicted, and at shutdown those still in memory, as safetensors files on disk
(SSD), found again by the same block index, loaded back on a hit, and after a restart. Each
namespace (a `cache_salt`'s hash, runner/prefix.py) is its own: its files name it, a lookup
finds only its own namespace's sequences, and no salt is written to disk, only its hash.

Files live in a folder named by the model's fingerprint: a hash of its weights' values (a
strided sample of every parameter), its dtype and the device, so a changed model (other files,
weights loaded in place, another dtype) never reads another's keys and values. Writes go
through one background thread; the least recently used files go first past the size limit.

A file is a cache, never the truth: each is written under a temporary name and renamed whole
(a server killed while writing leaves only a temporary file, removed at the next start), its
meta file (tokens, length, CRC-32) written last, and every read checks them. A file that fails
(corrupted, truncated, gone) and a write that fails (a full disk, a read-only folder) are
logged and read as a miss: the prompt is computed, and the server serves on.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from omlx_logprobs.batch.block_index import BlockIndex
from omlx_logprobs.runner.prefix import Prefix

log = logging.getLogger("omlx_logprobs")

SAMPLE = 64  # values read from each parameter for the fingerprint
DATA, META, TEMP = ".safetensors", ".json", ".tmp"
WARN_EVERY_S = 60.0  # a failing kind of read or write is logged at most this often


def fingerprint(model: Any) -> str:
    """A hash of the model's weights (their names, shapes, dtypes and a strided sample of each
    one's values) and the device: what the disk tier's files are keyed by."""
    h = hashlib.sha256(str(mx.default_device()).encode())
    params: Any = tree_flatten(model.parameters())
    for name, p in sorted(params, key=lambda x: x[0]):
        flat = p.reshape(-1)
        step = max(flat.size // SAMPLE, 1)
        h.update(f"{name}{p.shape}{p.dtype}".encode())
        h.update(np.array(flat[::step][:SAMPLE].astype(mx.float32)).tobytes())
    return h.hexdigest()[:24]


def file_name(tokens: tuple[int, ...], namespace: int = 0) -> str:
    """A sequence's files' name: a hash of its tokens and namespace (a read checks its meta file
    against it); the default namespace's names are those of its tokens alone."""
    what = (namespace, tokens) if namespace else tokens
    return hashlib.sha256(repr(what).encode()).hexdigest()[:32]


# A kept sequence on disk: its namespace and its tokens.
Stored = tuple[int, tuple[int, ...]]


class DiskTier:
    def __init__(self, root: str | Path, max_bytes: int, model_fingerprint: str) -> None:
        self.dir = Path(root).expanduser() / model_fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)  # OSError: the caller goes without
        self.max_bytes = max_bytes
        # LRU; a size is the bytes on disk (data and meta file), estimated until written.
        self.files: OrderedDict[Stored, tuple[str, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.hit_tokens = 0  # prefixes read back, and their tokens (/metrics)
        self._index: BlockIndex[str] = BlockIndex()
        self._writer = ThreadPoolExecutor(1, "omlx-kv-disk")
        self._pending: dict[str, Future[None]] = {}
        # Each write's outcome, from the writer thread: (what, name, bytes written or None).
        self._written: deque[tuple[Stored, str, int | None]] = deque()
        # A full disk fails every write: one warning a kind per WARN_EVERY_S, with a count
        self._warned: dict[str, tuple[float, int]] = {}
        self._read_existing()
        self._evict()

    def _read_existing(self) -> None:
        found = [(m.stem, f) for m in self.dir.glob(f"*{META}") if (f := _listed(m)) is not None]
        listed: set[str] = set()
        for name, (what, size, _) in sorted(found, key=lambda x: x[1][2]):  # by last use
            listed.add(name)
            self._add(what, name, size)
        # What a write cut short left (a temporary file, a data file without its meta file) or
        # a meta file that fails its checks: no entry, and no bytes held outside the limit.
        for path in self.dir.iterdir():
            if path.suffix == TEMP or path.name.split(".")[0] not in listed:
                _remove(path)
        if self.files:
            log.info("kv cache dir %s: %d sequences, %d MiB", self.dir, len(self.files),
                     self.nbytes >> 20)  # fmt: skip

    def put(self, prefix: Prefix, namespace: int = 0) -> None:
        """Keep a sequence of a namespace on disk (written by the background thread)."""
        self._settle()
        what = (namespace, prefix.tokens)
        if what in self.files or prefix.array_nbytes > self.max_bytes:
            return
        name = file_name(prefix.tokens, namespace)
        # Evaluated here: the writer thread has no MLX stream of its own to compute on.
        mx.eval(prefix.keys, prefix.values, prefix.states)
        self._add(what, name, prefix.array_nbytes)
        self._pending[name] = self._writer.submit(self._write, name, prefix, namespace)
        self._evict()

    def find(
        self, ids: Sequence[int], limit: int, namespace: int = 0, whole: bool = False
    ) -> tuple[tuple[int, ...], int] | None:
        """The namespace's kept sequence sharing the longest start with ids[:limit], and that
        length (`whole`: of those ids[:limit] starts with whole, BlockIndex.find)."""
        self._settle()
        found = self._index.find(namespace, ids, limit, whole=whole)
        return (found[0], found[2]) if found is not None else None

    def load(self, tokens: tuple[int, ...], namespace: int = 0) -> Prefix | None:
        """A kept sequence's keys and values, read back (waiting for its write if pending);
        None where its write failed or its files fail their checks (then forgotten)."""
        what = (namespace, tokens)
        if what not in self.files:
            return None
        name, _ = self.files[what]
        if (pending := self._pending.pop(name, None)) is not None:
            pending.result()
        self._settle()
        if what not in self.files:  # its write failed
            return None
        t0 = time.perf_counter()
        try:
            prefix = self._read(name, what)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            self._warn("read", f"{name} unreadable ({e}): computed again")
            self._drop(what)
            return None
        self.files.move_to_end(what)
        self.hits += 1
        self.hit_tokens += len(tokens)
        _touch(self.dir / f"{name}{META}")  # recently used, across restarts too
        log.debug("kv cache dir: %d tokens read in %.3f s", len(tokens), time.perf_counter() - t0)
        return prefix

    def flush(self) -> None:
        """Wait for every write and removal submitted (one thread: they run in order), and
        those the size limit asks for once the writes' sizes are known."""
        self._writer.submit(lambda: None).result()
        self._pending.clear()
        self._settle()
        self._writer.submit(lambda: None).result()

    def _read(self, name: str, what: Stored) -> Prefix:
        namespace, tokens = what
        meta = json.loads((self.dir / f"{name}{META}").read_text())
        data = (self.dir / f"{name}{DATA}").read_bytes()
        if tuple(meta["tokens"]) != tokens or meta.get("namespace", 0) != namespace:
            raise ValueError("its meta file names other tokens or another namespace")
        if len(data) != meta["bytes"] or zlib.crc32(data) != meta["crc32"]:
            raise ValueError(f"{len(data)} bytes, {meta['bytes']} written, checksum differs")
        arrays = mx.load(io.BytesIO(data), format="safetensors")
        assert isinstance(arrays, dict)
        n = sum(1 for a in arrays if a.startswith("k"))
        keys = [arrays[f"k{i}"] for i in range(n)]
        values = [arrays[f"v{i}"] for i in range(n)]
        if any(a.ndim != 4 or a.shape[2] != len(tokens) for a in keys + values):
            raise ValueError("keys or values of another length")
        states = _states(arrays)
        mx.eval(keys, values, states)
        return Prefix(tokens, keys, values, states=states)

    def _write(self, name: str, prefix: Prefix, namespace: int) -> None:
        arrays = {f"k{i}": k for i, k in enumerate(prefix.keys)}
        arrays |= {f"v{i}": v for i, v in enumerate(prefix.values)}
        for i, state in enumerate(prefix.states or ()):
            arrays |= {f"s{i}.{j}": a for j, a in enumerate(state)}
        written: int | None = None
        try:
            buffer = io.BytesIO()
            mx.save_safetensors(buffer, arrays)
            data = buffer.getvalue()
            meta = {"tokens": list(prefix.tokens), "bytes": len(data), "crc32": zlib.crc32(data)}
            if namespace:
                meta["namespace"] = namespace
            text = json.dumps(meta).encode()
            _write_file(self.dir / f"{name}{DATA}", data)
            # The meta file last: a sequence is listed only once its arrays are whole.
            _write_file(self.dir / f"{name}{META}", text)
            written = len(data) + len(text)
        except (OSError, RuntimeError, ValueError) as e:  # MLX's serializer raises the latter
            self._warn("write", f"{len(prefix.tokens)} tokens not written ({e})")
            for suffix in (META, DATA):
                _remove(self.dir / f"{name}{suffix}")
        self._written.append(((namespace, prefix.tokens), name, written))

    def _warn(self, kind: str, message: str) -> None:
        """Log a failed read or write, the first of its kind and then at most one each
        WARN_EVERY_S, saying how many were not logged since (from either thread: the GIL
        keeps the dict's updates whole; a count off by one is harmless)."""
        now = time.monotonic()
        last, quiet = self._warned.get(kind, (-WARN_EVERY_S, 0))
        if now - last < WARN_EVERY_S:
            self._warned[kind] = (last, quiet + 1)
            return
        more = f" ({quiet} more since the last)" if quiet else ""
        log.warning("kv cache dir: %s%s", message, more)
        self._warned[kind] = (now, 0)

    def _settle(self) -> None:
        """The writes' outcomes: a failed one's entry goes, a written one counts its bytes."""
        while self._written:
            what, name, written = self._written.popleft()
            entry = self.files.get(what)
            if entry is None or entry[0] != name:
                continue  # evicted meanwhile
            if written is None:
                self._forget(what)
            else:
                self.files[what] = (name, written)
                self.nbytes += written - entry[1]
        self._evict()

    def _add(self, what: Stored, name: str, size: int) -> None:
        self.files[what] = (name, size)
        self.nbytes += size
        self._index.add(what[0], what[1], name)

    def _forget(self, what: Stored) -> str:
        name, size = self.files.pop(what)
        self.nbytes -= size
        self._index.remove(what[0], what[1], name)
        return name

    def _drop(self, what: Stored) -> None:
        name = self._forget(what)
        self._writer.submit(self._delete, name, self._pending.pop(name, None))

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self.files:
            self._drop(next(iter(self.files)))

    def _delete(self, name: str, pending: Future[None] | None) -> None:
        if pending is not None:
            pending.result()
        for suffix in (META, DATA):
            _remove(self.dir / f"{name}{suffix}")


def _listed(meta: Path) -> tuple[Stored, int, float] | None:
    """A meta file's namespace and tokens, its sequence's bytes on disk and its last use; None
    where the two files do not match what it says (a write cut short, another format):
    neither is trusted."""
    try:
        found = json.loads(meta.read_text())
        tokens = tuple(int(t) for t in found["tokens"])
        namespace = int(found.get("namespace", 0))
        size = (meta.parent / f"{meta.stem}{DATA}").stat().st_size
        named = file_name(tokens, namespace) == meta.stem
        if not named or size != found["bytes"] or "crc32" not in found:
            return None
        stat = meta.stat()
        return (namespace, tokens), size + stat.st_size, stat.st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_file(path: Path, data: bytes) -> None:
    """Write a file whole or not at all: a temporary file renamed over it."""
    temp = path.with_name(path.name + TEMP)
    try:
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    except OSError:
        _remove(temp)
        raise


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:  # a read-only folder: the file stays, and so does its entry's absence
        log.debug("kv cache dir: %s not removed (%s)", path, e)


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError:
        pass  # a read-only folder: the order of use is this process's alone


def _states(arrays: dict[str, mx.array]) -> tuple[tuple[mx.array, ...], ...] | None:
    """A recurrent model's states as `_write` named them: s{layer}.{slot}."""
    layers: dict[int, dict[int, mx.array]] = {}
    for name, a in arrays.items():
        if name.startswith("s"):
            layer, slot = name[1:].split(".")
            layers.setdefault(int(layer), {})[int(slot)] = a
    if not layers:
        return None
    return tuple(tuple(s[j] for j in sorted(s)) for _, s in sorted(layers.items()))
