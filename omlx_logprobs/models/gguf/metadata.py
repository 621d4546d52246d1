"""A GGUF file's key-value metadata as plain Python values."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

_MISSING = object()


class Metadata:
    """Keys with `{arch}.` in front are read with `arch(key)`."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields
        self.architecture = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return default if value is None else value

    def arch(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(f"{self.architecture}.{key}", _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ValueError(f"GGUF metadata lacks {self.architecture}.{key}")
            return default
        return value

    def arch_int(self, key: str, default: Any = _MISSING) -> int:
        """A count that some files store per layer (an array): one value for all layers."""
        value = self.arch(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(
                    f"{self.architecture}.{key} differs between layers ({sorted(set(value))}):"
                    " such models are not supported from GGUF; use the Hugging Face directory"
                )
            value = value[0]
        return int(value)
