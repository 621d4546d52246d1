"""A few scalar keys of a GGUF file's metadata (`general.file_type` and the like), read by
walking the metadata until they are found: arrays are skipped over, never decoded. The `gguf`
package's full parse builds every array (a vocabulary of a hundred thousand strings) and every
tensor's view, seconds for a small model, where these take milliseconds."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO, Any

MAGIC = b"GGUF"
# GGUF's value types: the scalars' struct formats; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_keys(path: Path, wanted: set[str]) -> dict[str, Any]:
    """The wanted keys' scalar or string values (those the file has); {} for a file that is
    not GGUF version 2 or later."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC or struct.unpack("<I", f.read(4))[0] < 2:
            return {}
        _tensors, count = struct.unpack("<QQ", f.read(16))
        found: dict[str, Any] = {}
        for _ in range(count):
            if len(found) == len(wanted):
                break
            key = _string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            value = _value(f, kind)
            if key in wanted:
                found[key] = value
        return found


def _value(f: IO[bytes], kind: int) -> Any:
    """A scalar or string; an array is skipped (None)."""
    if kind == _STRING:
        return _string(f)
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, n = struct.unpack("<IQ", f.read(12))
    if item in _SCALARS:
        f.seek(n * struct.calcsize(_SCALARS[item]), 1)
    else:
        for _ in range(n):
            _value(f, item)
    return None


def _string(f: IO[bytes]) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")
