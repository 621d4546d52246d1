"""Two CPU lists for `taskset -c`, each holding whole physical cores (both hyperthreads), the
first half of this process's allowed cores and the second: a server and its load generator
placed apart, so that neither runs on the other's hyperthread siblings."""

from __future__ import annotations

import os
from pathlib import Path


def core_of(cpu: int) -> tuple[str, str]:
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    package = (topo / "physical_package_id").read_text().strip()
    return package, (topo / "core_id").read_text().strip()


def halves() -> tuple[list[int], list[int]]:
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        cores.setdefault(core_of(cpu), []).append(cpu)
    groups = list(cores.values())
    half = max(len(groups) // 2, 1)
    return [c for g in groups[:half] for c in g], [c for g in groups[half:] for c in g]


if __name__ == "__main__":
    first, second = halves()
    print(",".join(map(str, first)), ",".join(map(str, second or first)))
