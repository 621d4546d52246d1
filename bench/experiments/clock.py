"""Wall time of named calls in one process, for the in-process experiments (turn_phases.py,
spec_engine.py): `timed` puts a wrapper in place of a method or a function."""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Any


def timed(
    owner: Any,
    name: str,
    totals: dict[str, float],
    calls: dict[str, list[float]],
    label: str | None = None,
    listed: Container[str] | None = None,
) -> None:
    """Wrap owner.name: each call's seconds add to totals[label or name], and its ms (to 0.1)
    go on calls[label or name] where `listed` is None or holds that label (both dicts
    defaultdicts)."""
    inner = getattr(owner, name)
    key = label or name

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            totals[key] += dt
            if listed is None or key in listed:
                calls[key].append(round(dt * 1e3, 1))

    setattr(owner, name, wrapper)
