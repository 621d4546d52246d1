"""The prefix cache's disk tier (`--kv-cache-dir`): the base model's kept sequences that the
memory budget evicted, and at shutdown those still in memory, as safetensors files on disk
(SSD), found again by the same block index, loaded back on a hit, and after a restart.

Files live in a folder named by the model's fingerprint: a hash of its weights' values (a
strided sample of every parameter), its dtype and the device, so a changed model (other files,
weights loaded in place, another dtype) never reads another's keys and values. Writes go
through one background thread; the least recently used files go first past the size limit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
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


class DiskTier:
    def __init__(self, root: str | Path, max_bytes: int, model_fingerprint: str) -> None:
        self.dir = Path(root).expanduser() / model_fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.files: OrderedDict[tuple[int, ...], tuple[str, int]] = OrderedDict()  # LRU
        self.nbytes = 0
        self._index: BlockIndex[str] = BlockIndex()
        self._writer = ThreadPoolExecutor(1, "omlx-kv-disk")
        self._pending: dict[str, Future[None]] = {}
        self._read_existing()

    def _read_existing(self) -> None:
        metas = sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for meta in metas:
            data = self.dir / (meta.stem + ".safetensors")
            try:
                tokens = tuple(json.loads(meta.read_text())["tokens"])
                size = data.stat().st_size
            except (OSError, ValueError, KeyError):
                continue  # a write cut short: neither file is trusted
            self._add(tokens, meta.stem, size)
        if self.files:
            log.info("kv cache dir %s: %d sequences, %d MiB", self.dir, len(self.files),
                     self.nbytes >> 20)  # fmt: skip

    def put(self, prefix: Prefix) -> None:
        """Keep a sequence on disk (written by the background thread)."""
        if prefix.tokens in self.files or prefix.array_nbytes > self.max_bytes:
            return
        name = hashlib.sha256(repr(prefix.tokens).encode()).hexdigest()[:32]
        # Evaluated here: the writer thread has no MLX stream of its own to compute on.
        mx.eval(prefix.keys, prefix.values, prefix.states)
        self._add(prefix.tokens, name, prefix.array_nbytes)
        self._pending[name] = self._writer.submit(self._write, name, prefix)
        self._evict()

    def find(
        self, ids: Sequence[int], limit: int, whole: bool = False
    ) -> tuple[tuple[int, ...], int] | None:
        """The kept sequence sharing the longest start with ids[:limit], and that length
        (`whole`: of those ids[:limit] starts with whole, BlockIndex.find)."""
        found = self._index.find(None, ids, limit, whole=whole)
        return (found[0], found[2]) if found is not None else None

    def load(self, tokens: tuple[int, ...]) -> Prefix:
        """A kept sequence's keys and values, read back (waiting for its write if pending)."""
        name, _ = self.files[tokens]
        self.files.move_to_end(tokens)
        if (pending := self._pending.pop(name, None)) is not None:
            pending.result()
        t0 = time.perf_counter()
        arrays = mx.load(str(self.dir / f"{name}.safetensors"))
        assert isinstance(arrays, dict)
        n = sum(1 for name in arrays if name.startswith("k"))
        keys = [arrays[f"k{i}"] for i in range(n)]
        values = [arrays[f"v{i}"] for i in range(n)]
        states = _states(arrays)
        mx.eval(keys, values, states)
        (self.dir / f"{name}.json").touch()  # recently used, across restarts too
        log.debug("kv cache dir: %d tokens read in %.3f s", len(tokens), time.perf_counter() - t0)
        return Prefix(tokens, keys, values, states=states)

    def flush(self) -> None:
        """Wait for every write and removal submitted (one thread: they run in order)."""
        self._writer.submit(lambda: None).result()
        self._pending.clear()

    def _write(self, name: str, prefix: Prefix) -> None:
        arrays = {f"k{i}": k for i, k in enumerate(prefix.keys)}
        arrays |= {f"v{i}": v for i, v in enumerate(prefix.values)}
        for i, state in enumerate(prefix.states or ()):
            arrays |= {f"s{i}.{j}": a for j, a in enumerate(state)}
        mx.save_safetensors(str(self.dir / f"{name}.safetensors"), arrays)
        # The tokens last: a sequence is listed only once its arrays are whole.
        (self.dir / f"{name}.json").write_text(json.dumps({"tokens": list(prefix.tokens)}))

    def _add(self, tokens: tuple[int, ...], name: str, size: int) -> None:
        self.files[tokens] = (name, size)
        self.nbytes += size
        self._index.add(None, tokens, name)

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and len(self.files) > 1:
            tokens, (name, size) = self.files.popitem(last=False)
            self.nbytes -= size
            self._index.remove(None, tokens, name)
            pending = self._pending.pop(name, None)
            self._writer.submit(self._delete, name, pending)

    def _delete(self, name: str, pending: Future[None] | None) -> None:
        if pending is not None:
            pending.result()
        for suffix in (".json", ".safetensors"):
            (self.dir / f"{name}{suffix}").unlink(missing_ok=True)


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
