"""The guard: every feature on by default costs nothing on the requests it does not help.

One run: servers of this tree side by side (the defaults, and each feature switched off), the
same requests to each, in rounds whose order turns every round, so that the machine's speed
phases fall on every side alike. For each feature, the ratio of its on and unused side to its
off side (higher is faster), the median over the rounds, at each concurrency; the run fails
(exit 1) when one falls under the floor (0.97).

- prefix cache: the defaults against `--prefix-cache-mib 0` (prompts that share only the chat
  template's start, nothing reused);
- prediction mode: the defaults (`--speculate prediction`) against `--speculate off`, on
  requests that send no prediction;
- a wrong prediction: the defaults, requests with a `prediction` no output ever matches against
  the same requests without one;
- prompt lookup: `--speculate lookup` against `--speculate off` on free chat;
- process engine: the defaults (the engine in a process of its own) against `--engine thread`;
- metrics: the defaults (`/metrics`, every output observed) against `--no-metrics`;
- token-faithful conversations: the defaults (every answer's ids remembered) against
  `--faithful-answers 0`, on requests that send no earlier answer back.

The servers are started anew for each launch (`--launches`, the rounds split among them), in
an order that turns every launch: on the 2-core box a server started first of three read 5%
slower than an identical one started last, so a fixed start order biased every ratio with the
default server on one side.

c = 1: one stream, streamed requests one after another, the per-token latency after the first
token, as ms per token; the cells take turns request by request (a vCPU's speed phase then
falls on each side of a ratio alike), a round's value the median over its requests, the verdict
the ratio of the medians over every request of each side. Higher concurrency: a closed loop of
non-streamed requests, completion tokens/s, the verdict the median of the rounds' ratios.
Top-20 logprobs on every request (`--top`).

    .venv/bin/python -m bench.guard                  # make bench-guard: the CPU preset (~10 min)
    python3 -m bench.guard --preset gpu --model /root/m1b --share-cores  # GPU host

Timing is no test: this is not in `make test`. Run it before a change to the step loop is
called done, and put its table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.cpu_halves import halves
from bench.loadgen import LoadConfig, run_load
from bench.server import Server, free_port, omlx_command, start_server

FLOOR = 0.97
EMBEDDED = "SmolLM2-135M-Instruct"
# Text in a script the served models never answer these prompts in: its tokens are never
# drafted (a prediction drafts from a one-token match), so it is a prediction that is wrong.
WRONG_PREDICTION = "ぁぃぅぇぉかきくけこさしすせそ" * 12

# Servers: name -> the flags that differ from the defaults.
SERVERS: dict[str, list[str]] = {
    "default": [],
    "no-prefix-cache": ["--prefix-cache-mib", "0"],
    "no-speculation": ["--speculate", "off"],
    "lookup": ["--speculate", "lookup"],
    "thread-engine": ["--engine", "thread"],
    "no-metrics": ["--no-metrics"],
    "no-faithful": ["--faithful-answers", "0"],
    "batch-invariant": ["--batch-invariant"],
    # The defaults again: a second server like the first, whose ratio is the guard's own noise
    "default-again": [],
}


@dataclass(frozen=True)
class Cell:
    """What one measurement sends where: a server, and whether its requests carry the wrong
    prediction."""

    server: str
    wrong_prediction: bool = False

    @property
    def name(self) -> str:
        return self.server + (" + wrong prediction" if self.wrong_prediction else "")


@dataclass(frozen=True)
class Pair:
    feature: str
    on: Cell  # the feature on (and unused by these requests)
    off: Cell  # the feature off


PAIRS = (
    Pair("prefix cache on / off", Cell("default"), Cell("no-prefix-cache")),
    Pair("prediction mode, none sent / speculation off", Cell("default"), Cell("no-speculation")),
    Pair("a wrong prediction / none", Cell("default", True), Cell("default")),
    Pair("prompt lookup / speculation off", Cell("lookup"), Cell("no-speculation")),
    Pair("process engine / thread engine", Cell("default"), Cell("thread-engine")),
    Pair("metrics on / off", Cell("default"), Cell("no-metrics")),
    Pair("token-faithful store on / off", Cell("default"), Cell("no-faithful")),
)
# Modes a request or server asks for, measured against the default when `--servers` names
# them (no floor: what they cost is published, docs/benchmarks.md).
MODES = (
    Pair("batch-invariant mode / default", Cell("batch-invariant"), Cell("default")),
    Pair("the defaults / the defaults again (noise)", Cell("default"), Cell("default-again")),
)


@dataclass(frozen=True)
class Preset:
    model: str | None  # None: the embedded model
    concurrencies: tuple[int, ...]
    max_tokens: int
    prompt_words: int
    stream_requests: int  # a c=1 measurement's requests
    waves: int  # a higher concurrency's requests, in waves of it
    rounds: int
    launches: int  # the servers started this many times, in turning order


PRESETS = {
    "cpu": Preset(None, (1, 32), 32, 16, 2, 1, 6, 3),
    # Cells of two requests or waves and 15 rounds: each vCPU of a GPU host switches between two
    # speeds for seconds at a time; short cells keep the two sides of a ratio in one phase.
    # One launch: a server there takes ~40 s to start (its shapes built), and the start-order
    # bias was the 2-core box's.
    "gpu": Preset(None, (1, 64), 128, 32, 4, 2, 15, 1),
}


@dataclass
class Results:
    # (concurrency, cell name) -> each round's value: ms per token at c = 1, else tokens/s
    values: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    # c = 1: every request's ms per token, all rounds together
    requests: dict[str, list[float]] = field(default_factory=dict)

    def add(self, c: int, cell: Cell, value: float) -> None:
        self.values.setdefault((c, cell.name), []).append(value)

    def ratio(self, c: int, pair: Pair) -> float:
        """The verdict's on / off speed. c = 1: the ratio of every request's median, each side
        (a round's four requests read +-15% on the H200, a median over all of them +-2%);
        else the median of the rounds' ratios."""
        if c == 1:
            on, off = self.requests[pair.on.name], self.requests[pair.off.name]
            return statistics.median(off) / statistics.median(on)
        return statistics.median(self.ratios(c, pair))

    def ratios(self, c: int, pair: Pair) -> list[float]:
        """Each round's on / off speed (at c = 1 the latencies' inverse ratio)."""
        on, off = self.values[(c, pair.on.name)], self.values[(c, pair.off.name)]
        if c == 1:
            return [b / a for a, b in zip(on, off)]
        return [a / b for a, b in zip(on, off)]


def cells(pairs: tuple[Pair, ...]) -> list[Cell]:
    seen: dict[str, Cell] = {}
    for p in pairs:
        for c in (p.on, p.off):
            seen.setdefault(c.name, c)
    return list(seen.values())


async def measure(
    server: Server, cell: Cell, c: int, preset: Preset, top: int, seed: int, requests: int = 0
) -> float:
    """One measurement: ms per token of one stream (c = 1; the median over `requests`, default
    the preset's), else completion tokens/s."""
    one = c == 1
    cfg = LoadConfig(
        base_url=server.base_url,
        model=Path(preset.model).name if preset.model else EMBEDDED,
        concurrency=c,
        requests=requests or (preset.stream_requests if one else c * preset.waves),
        max_tokens=preset.max_tokens,
        logprobs=top,
        stream=one,
        prompt_words=preset.prompt_words,
        seed=seed,
        prediction=WRONG_PREDICTION if cell.wrong_prediction else None,
    )
    res = await run_load(cfg)
    if res.errors:
        raise RuntimeError(f"{cell.name}, c={c}: {res.errors} errors: {res.error_samples}")
    if not one:
        return res.tokens_per_s
    per_token = [
        (r.latency_s - r.ttft_s) / (r.completion_tokens - 1) * 1e3
        for r in res.records
        if r.ttft_s is not None and r.completion_tokens > 1
    ]
    return statistics.median(per_token)


async def run(
    preset: Preset,
    servers: dict[str, Server],
    top: int,
    pairs: tuple[Pair, ...],
    results: Results,
    rounds: range,
) -> None:
    """Measure `rounds` (numbered across every launch) on one launch's servers."""
    order = cells(pairs)
    for c in preset.concurrencies:
        for cell in order:  # unmeasured: each server's shapes at this concurrency built
            await measure(servers[cell.server], cell, c, preset, top, seed=999)
        for r in rounds:
            turn = order[r % len(order) :] + order[: r % len(order)]
            turn = turn if r % 2 == 0 else turn[::-1]
            # c = 1: the cells take turns request by request, each request its own measure
            taking = preset.stream_requests if c == 1 else 1
            values: dict[str, list[float]] = {cell.name: [] for cell in order}
            for k in range(taking):
                for cell in turn if k % 2 == 0 else turn[::-1]:
                    # Prompts no server has seen: two cells of one server with the same prompts
                    # measured the second's cache hits (a wrong prediction read 1.25x of none).
                    seed = 1000 * (r + 1) + 50 * k + order.index(cell)
                    values[cell.name].append(
                        await measure(
                            servers[cell.server], cell, c, preset, top, seed, 1 if c == 1 else 0
                        )
                    )
            for cell in order:
                results.add(c, cell, statistics.median(values[cell.name]))
                if c == 1:
                    results.requests.setdefault(cell.name, []).extend(values[cell.name])
            print(
                f"c={c} round {r + 1}: "
                + ", ".join(f"{cl.name} {results.values[(c, cl.name)][-1]:.2f}" for cl in order),
                flush=True,
            )


def start_order(names: list[str], launch: int) -> list[str]:
    """The order a launch starts its servers in: turned by one each launch, so that over as
    many launches as servers each is started first once, and last once."""
    k = launch % len(names)
    return names[k:] + names[:k]


def report(
    preset: Preset, results: Results, floor: float, pairs: tuple[Pair, ...]
) -> tuple[str, bool]:
    """The table (markdown) and whether every ratio is at or above the floor."""
    lines = [
        "| feature (on and unused / off) | c | ratio | round by round | met |",
        "|---|---:|---:|---|---|",
    ]
    ok = True
    for c in preset.concurrencies:
        for pair in pairs:
            ratios = results.ratios(c, pair)
            med = results.ratio(c, pair)
            met = med >= floor or pair in MODES
            ok = ok and met
            rounds = " ".join(f"{x:.2f}" for x in ratios)
            lines.append(
                f"| {pair.feature} | {c} | {med:.3f} | {rounds} | {'yes' if met else '**no**'} |"
            )
    lines += ["", "| cell | c | median | unit |", "|---|---:|---:|---|"]
    for (c, name), values in results.values.items():
        unit = "ms per token" if c == 1 else "tokens/s"
        lines.append(f"| {name} | {c} | {statistics.median(values):.2f} | {unit} |")
    return "\n".join(lines), ok


def pinned(n: int) -> list[list[int] | None]:
    """n disjoint sets of this process's cores, one a server, the rest left to this process
    (the clients); no pinning where there are too few cores for it."""
    cores = sorted(os.sched_getaffinity(0))
    each = (len(cores) - 2) // n
    if each < 2:
        return [None] * n
    os.sched_setaffinity(0, cores[n * each :])
    return [cores[i * each : (i + 1) * each] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument(
        "--launches",
        type=int,
        default=None,
        help="start the servers this many times, in turning order, the rounds split among them",
    )
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--top", type=int, default=20, help="top logprobs on every request")
    ap.add_argument("--floor", type=float, default=FLOOR)
    ap.add_argument(
        "--servers",
        type=lambda v: set(v.split(",")),
        default=None,
        help=f"only the pairs between these servers (comma-separated, of {', '.join(SERVERS)})",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every round's values here")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="each server on cores of its own, the clients on the rest (a GPU host: each"
        " server's threads then stay where they are; on the 2-core CPU box all share both)",
    )
    ap.add_argument(
        "--share-cores",
        action="store_true",
        help="every server on the same half of the cores, the clients on the other (servers"
        " compared then meet the same vCPU speed phases; one runs at a time)",
    )
    ap.add_argument(
        "--logs", type=Path, default=None, help="copy each server's log into this folder"
    )
    a = ap.parse_args()
    preset = PRESETS[a.preset]
    preset = Preset(
        a.model or preset.model,
        tuple(a.concurrency or preset.concurrencies),
        a.max_tokens or preset.max_tokens,
        preset.prompt_words,
        preset.stream_requests,
        preset.waves,
        a.rounds or preset.rounds,
        a.launches or preset.launches,
    )
    pairs = tuple(p for p in PAIRS if not a.servers or {p.on.server, p.off.server} <= a.servers)
    pairs += tuple(p for p in MODES if a.servers and {p.on.server, p.off.server} <= a.servers)
    wanted = {c.server for c in cells(pairs)}
    max_seqs = max(max(preset.concurrencies), 64)
    cores: list[list[int] | None] = pinned(len(SERVERS)) if a.pin else [None] * len(SERVERS)
    if a.share_cores:
        first, second = halves()
        os.sched_setaffinity(0, second)
        cores = [first] * len(SERVERS)
    where = dict(zip(SERVERS, cores))
    results = Results()
    problems: dict[str, list[str]] = {}
    launches = max(1, min(preset.launches, preset.rounds))
    for launch in range(launches):
        servers: dict[str, Server] = {}
        try:
            for name in start_order([n for n in SERVERS if n in wanted], launch):
                port = free_port()
                command = omlx_command(port, preset.model, max_seqs) + SERVERS[name]
                servers[name] = start_server(command, port, cpus=where[name])
                print(
                    f"launch {launch + 1}: {name} ready in {servers[name].startup_s:.1f} s"
                    f" ({' '.join(SERVERS[name])})",
                    flush=True,
                )
            # The rounds split among the launches as evenly as they go
            rounds = range(
                launch * preset.rounds // launches, (launch + 1) * preset.rounds // launches
            )
            asyncio.run(run(preset, servers, a.top, pairs, results, rounds))
            for n, s in servers.items():
                problems.setdefault(n, []).extend(s.log_problems())
        finally:
            for name, s in servers.items():
                s.stop()
                if a.logs is not None:
                    a.logs.mkdir(parents=True, exist_ok=True)
                    (a.logs / f"{name}-{launch + 1}.log").write_text(s.log_text())
    problems = {n: lines for n, lines in problems.items() if lines}
    table, ok = report(preset, results, a.floor, pairs)
    print(table)
    for name, lines in problems.items():
        print(f"{name}: server log problems: {lines[:5]}")
    if a.json is not None:
        values = {f"c={c} {name}": v for (c, name), v in results.values.items()}
        a.json.write_text(json.dumps({"preset": a.preset, "values": values}, indent=1))
    print("guard: every feature within the floor" if ok else f"guard: FAILED (floor {a.floor})")
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
