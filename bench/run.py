"""The runner behind `make bench`: start the server, warm it up, measure the preset's matrix,
print the table and regenerate the preset's section of docs/benchmarks.md.

    .venv/bin/python bench/run.py --preset cpu

Adding a preset: a `Preset` in PRESETS. Adding a target: a command in server.py and a branch in
`server_command` (HTTP servers), or a driver beside `run_load` for targets without HTTP such as
bare mlx-lm BatchGenerator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from loadgen import LoadConfig, LoadResult, merge, run_load
from report import Cell, Report, machine_facts, section, stream_table, table, write_section
from server import REPO, Server, free_port, mlx_lm_command, omlx_command, start_server


@dataclass(frozen=True)
class CellSpec:
    concurrency: int
    requests_per_run: int
    rounds: int  # 2: off, on, on, off (cancels linear drift); 1: one run of each mode


@dataclass(frozen=True)
class Preset:
    name: str
    target: str  # "omlx"; later "mlx-lm" (its server), "batchgen" (bare BatchGenerator)
    model: str | None  # None: the embedded SmolLM2-135M-Instruct
    served_name: str
    max_num_seqs: int
    max_tokens: int
    prompt_words: int
    top_k: int
    cells: tuple[CellSpec, ...]
    streams: tuple[tuple[int, int], ...]  # (concurrency, requests), with top_logprobs=top_k
    warmup_tokens: int = 4


# Sized on the 2-core CPU bench box, where prefill runs at only ~100-200 tokens/s: about 6 minutes
# when the box is quiet, about 10 when other jobs take a quarter of it (budget: 12). Every cell
# runs off/on/on/off; at c=32 each run is a single wave of 32 requests.
CPU = Preset(
    name="cpu",
    target="omlx",
    model=None,
    served_name="SmolLM2-135M-Instruct",
    max_num_seqs=64,
    max_tokens=64,
    prompt_words=32,
    top_k=20,
    cells=(CellSpec(1, 3, 2), CellSpec(8, 16, 2), CellSpec(32, 32, 2)),
    streams=((8, 8),),
)

# "gpu" (a bigger model, concurrency up to 128, more requests) goes here once an Apple-silicon or
# CUDA box runs the bench; so do the mlx-lm comparison presets, as separate targets.
# A seconds-long check that the runner, server and verification work end to end (use --no-docs).
SMOKE = replace(
    CPU, name="smoke", max_tokens=8, cells=(CellSpec(1, 2, 1), CellSpec(4, 4, 1)), streams=((2, 2),)
)
PRESETS: dict[str, Preset] = {"cpu": CPU, "smoke": SMOKE}


def server_command(p: Preset, port: int) -> list[str]:
    if p.target == "omlx":
        return omlx_command(port, p.model, p.max_num_seqs)
    if p.target == "mlx-lm" and p.model:
        return mlx_lm_command(port, p.model)
    raise SystemExit(f"target {p.target!r} is not built yet")


def busy_cpu_s() -> float:
    """CPU seconds all processes have used since boot, from /proc/stat."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = f[3] + f[4]  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


now = time.monotonic


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shown(cmd: list[str]) -> str:
    """A command line as someone would type it in the repo root."""
    parts = [os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd]
    return shlex.join(parts)


class Bench:
    def __init__(self, preset: Preset, server: Server) -> None:
        self.p = preset
        self.server = server
        self.seed = 0  # bumped per run: no prompt is ever sent twice, so no cache can help
        self.other_cpu = 0.0  # share of all cores other processes used during the last run

    async def load(
        self,
        concurrency: int,
        requests: int,
        logprobs: int | None,
        stream: bool = False,
        max_tokens: int | None = None,
    ) -> LoadResult:
        self.seed += 1
        cfg = LoadConfig(
            base_url=self.server.base_url,
            model=self.p.served_name,
            concurrency=concurrency,
            requests=requests,
            max_tokens=max_tokens or self.p.max_tokens,
            logprobs=logprobs,
            stream=stream,
            prompt_words=self.p.prompt_words,
            seed=self.seed,
        )
        busy0, self0, server0, t0 = busy_cpu_s(), time.process_time(), self.server.cpu_s(), now()
        res = await run_load(cfg)
        # Other processes on this box skew every number: measure how much CPU they took meanwhile.
        mine = time.process_time() - self0 + self.server.cpu_s() - server0
        other = (busy_cpu_s() - busy0 - mine) / ((now() - t0) * (os.cpu_count() or 1))
        self.other_cpu = max(0.0, other)  # clock-tick rounding can dip below zero
        mode = "off" if logprobs is None else f"top{logprobs}"
        err = f", {res.errors} ERRORS {res.error_samples[:1]}" if res.errors else ""
        log(
            f"  c={concurrency:<3} {mode:<5} {'stream ' if stream else ''}n={requests:<3} "
            f"{res.tokens_per_s:7.1f} tok/s  wall {res.wall_s:6.1f} s  "
            f"p50 {res.latency_p50_s:6.2f} s  others {self.other_cpu:4.0%}{err}"
        )
        return res

    async def warmup(self) -> float:
        """One cold request without logprobs, then a short-output wave with logprobs at each
        concurrency, so batch sizes and the logprobs path have run before anything is timed."""
        log("warm-up:")
        cold = await self.load(1, 1, None, max_tokens=self.p.warmup_tokens)
        for c in sorted({spec.concurrency for spec in self.p.cells}):
            await self.load(c, c, self.p.top_k, max_tokens=self.p.warmup_tokens)
        return cold.latency_mean_s

    async def cell(self, spec: CellSpec, on_first: bool) -> Cell:
        order = [on_first, not on_first]
        modes: list[bool] = []
        for r in range(spec.rounds):
            modes += order if r % 2 == 0 else order[::-1]
        runs: dict[bool, list[LoadResult]] = {False: [], True: []}
        others: dict[bool, float] = {False: 0.0, True: 0.0}
        for on in modes:
            lp = self.p.top_k if on else None
            runs[on].append(await self.load(spec.concurrency, spec.requests_per_run, lp))
            others[on] = max(others[on], self.other_cpu)
        off, on_ = merge(runs[False]), merge(runs[True])
        return Cell(spec.concurrency, len(runs[True]), off, on_, (others[False], others[True]))


async def bench(preset: Preset, server: Server, rep: Report) -> None:
    b = Bench(preset, server)
    rep.cold_latency_s = await b.warmup()
    log("measure:")
    for i, spec in enumerate(preset.cells):
        # Alternate which mode goes first between cells so neither always runs warmer.
        rep.cells.append(await b.cell(spec, on_first=i % 2 == 1))
    for c, n in preset.streams:
        rep.streams.append(await b.load(c, n, preset.top_k, stream=True))
        rep.stream_other_cpu.append(b.other_cpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a benchmark preset against a fresh server.")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--model", default=None, help="override the preset's model (dir or .gguf)")
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--no-docs", action="store_true", help="print only; leave the docs alone")
    ap.add_argument("--json", type=Path, default=None, help="also write raw results here")
    a = ap.parse_args(argv)
    preset = PRESETS[a.preset]
    if a.model:
        preset = replace(preset, model=a.model, served_name=Path(a.model).stem)

    t0 = time.perf_counter()
    port = free_port()
    cmd = server_command(preset, port)
    log(f"starting: {shown(cmd)}")
    server = start_server(cmd, port)
    log(f"ready in {server.startup_s:.1f} s; BLAS: {server.blas_line()}")
    rep = Report(
        preset=preset.name,
        runner_cmd=shown([sys.executable, "bench/run.py", *sys.argv[1:]]),
        server_cmd=shown(cmd),
        blas=server.blas_line(),
        max_tokens=preset.max_tokens,
        prompt_words=preset.prompt_words,
        top_k=preset.top_k,
        startup_s=server.startup_s,
        cold_latency_s=0.0,
        total_s=0.0,
    )
    server0, m0 = server.cpu_s(), now()
    try:
        asyncio.run(bench(preset, server, rep))
        rep.server_cores = (server.cpu_s() - server0) / (now() - m0)
    finally:
        server.stop()
    rep.server_problems = server.log_problems()
    rep.total_s = time.perf_counter() - t0

    print(table(rep))
    print()
    print(stream_table(rep))
    print(f"\npreset total {rep.total_s:.0f} s; server log problems: {len(rep.server_problems)}")
    for line in rep.server_problems[:10]:
        print("  " + line)
    errors = sum(c.off.errors + c.on.errors for c in rep.cells) + sum(s.errors for s in rep.streams)
    noisy = [c.concurrency for c in rep.cells if max(c.other_cpu) > 0.10]
    if noisy:
        rep.notes.append(
            f"Other processes took over 10% of the CPU at concurrency {noisy}: rerun on a quiet "
            "machine before trusting those rows."
        )
    if errors:
        rep.notes.append(f"**{errors} requests failed**: these numbers are not valid.")
    if not a.no_docs:
        write_section(a.docs, preset.name, section(rep, machine_facts(REPO)))
        log(f"wrote {a.docs}")
    if a.json:
        raw = {
            "cells": [
                {"c": c.concurrency, "off": c.off.to_json(), "on": c.on.to_json()}
                for c in rep.cells
            ],
            "streams": [s.to_json() for s in rep.streams],
            "server_log": str(server.log_path),
        }
        a.json.write_text(json.dumps(raw, indent=2, default=str))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
