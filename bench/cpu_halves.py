"""Two CPU lists for `taskset -c`, each holding whole physical cores (both hyperthreads), the
first half of this process's allowed cores and the second: a server and its load generator
placed apart, so that neither runs on the other's hyperthread siblings."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Set by `python -m bench.run --pin`: the CPUs every server (and bare.py) is started on; the
# runner and its load generator processes keep the other half.
SERVER_CPUS_ENV = "BENCH_SERVER_CPUS"


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


def pin_halves() -> tuple[list[int], list[int]]:
    """Put this process (and every load generator it starts) on the second half of the cores
    and name the first half for the servers it starts (`server_affinity`)."""
    first, second = halves()
    if second:
        os.environ[SERVER_CPUS_ENV] = ",".join(map(str, first))
        os.sched_setaffinity(0, second)
    return first, second


def server_affinity() -> Callable[[], None] | None:
    """A `preexec_fn` that moves a server's process onto the servers' half, under --pin."""
    cpus = os.environ.get(SERVER_CPUS_ENV)
    if not cpus:
        return None
    ids = [int(c) for c in cpus.split(",")]
    return lambda: os.sched_setaffinity(0, ids)


if __name__ == "__main__":
    first, second = halves()
    print(",".join(map(str, first)), ",".join(map(str, second or first)))
