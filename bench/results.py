"""What a benchmark run measured, as typed records that survive a JSON round trip.

A run is made of parts (our server, mlx-lm's server, bare mlx-lm, the memory soak); a later run
of only some parts replaces those parts in the saved results and keeps the others, so a preset
too long for one command can be measured in two and still give one table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PARTS = ("omlx", "mlx-lm", "batchgen", "memory", "quantized")


@dataclass
class Throughput:
    """One (target, logprobs mode, concurrency) cell, merged over its runs."""

    target: str  # "omlx", "mlx-lm" or "batchgen"
    mode: str  # "off", "top0", "top5", "top20"
    concurrency: int
    requests: int  # over all runs
    runs: int
    tokens_per_s: float
    latency_p50_s: float | None
    errors: int = 0
    other_cpu: float = 0.0  # worst share of the machine other processes took during a run
    error_samples: list[str] = field(default_factory=list)
    run_tokens_per_s: list[float] = field(default_factory=list)  # each run's, round by round
    clients: str = ""  # the client set-up ("": the preset's own)
    # Our server's decode-only steps during the runs (its stats lines): how many, their mean
    # host launch time and rows; None where the server logs none (mlx-lm, bare mlx-lm).
    decode_steps: int = 0
    host_ms: float | None = None
    step_rows: float | None = None


@dataclass
class Scoring:
    """Prompt tokens/s of one load shape: `score` (echo, max_tokens 0, logprobs 1), `prefill`
    (our server, max_tokens 1, no logprobs) or `bare` (mlx-lm BatchGenerator, 1 token)."""

    kind: str
    concurrency: int
    requests: int
    prompt_tokens: int  # over all requests
    tokens_per_s: float | None  # None: not measured (see note)
    errors: int = 0
    note: str = ""


@dataclass
class Ttft:
    """Time to first token at concurrency 1: `omlx` (streaming over HTTP, first non-empty
    content delta) or `generate` (mlx-lm stream_generate in-process, first non-empty text)."""

    source: str
    requests: int
    prompt_tokens: int | None
    median_s: float
    p90_s: float
    first_token_median_s: float | None = None  # generate only: first token, text or not
    errors: int = 0


@dataclass
class MemoryPoint:
    requests_done: int
    rss_mib: float


@dataclass
class Memory:
    concurrency: int
    max_tokens: int
    top_k: int
    warm_rss_mib: float
    points: list[MemoryPoint] = field(default_factory=list)
    errors: int = 0

    @property
    def growth(self) -> float | None:
        if not self.points or self.warm_rss_mib <= 0:
            return None
        return self.points[-1].rss_mib / self.warm_rss_mib - 1.0


@dataclass
class PartResult:
    part: str  # one of PARTS
    finished: str  # local time the part finished
    seconds: float
    runner_cmd: str
    server_cmd: str | None = None  # the server or subprocess command line
    startup_s: float | None = None
    blas: str | None = None
    server_cores: float | None = None
    problems: list[str] = field(default_factory=list)  # server log lines that look like failures
    throughput: list[Throughput] = field(default_factory=list)
    scoring: list[Scoring] = field(default_factory=list)
    ttft: list[Ttft] = field(default_factory=list)
    memory: Memory | None = None
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def from_json(d: dict[str, Any]) -> PartResult:
        mem = d.get("memory")
        return PartResult(
            **{
                **d,
                "throughput": [Throughput(**t) for t in d.get("throughput", [])],
                "scoring": [Scoring(**s) for s in d.get("scoring", [])],
                "ttft": [Ttft(**t) for t in d.get("ttft", [])],
                "memory": None
                if mem is None
                else Memory(**{**mem, "points": [MemoryPoint(**p) for p in mem["points"]]}),
            }
        )


@dataclass
class Results:
    preset: str
    model: str  # what was served, as a path or name
    facts: list[tuple[str, str]] = field(default_factory=list)
    parts: list[PartResult] = field(default_factory=list)
    # A GPU's decode floor: the weights' bytes over its memory bandwidth (ms), and how it was
    # taken; None on the CPU.
    floor_ms: float | None = None
    floor_note: str = ""

    def part(self, name: str) -> PartResult | None:
        return next((p for p in self.parts if p.part == name), None)

    def replace_part(self, new: PartResult) -> None:
        self.parts = [p for p in self.parts if p.part != new.part] + [new]
        self.parts.sort(key=lambda p: PARTS.index(p.part))

    def throughput(
        self, target: str, mode: str, concurrency: int, clients: str = ""
    ) -> Throughput | None:
        for p in self.parts:
            for t in p.throughput:
                if (t.target, t.mode, t.concurrency, t.clients) == (
                    target, mode, concurrency, clients
                ):  # fmt: skip
                    return t
        return None

    def concurrencies(self) -> list[int]:
        return sorted({t.concurrency for p in self.parts for t in p.throughput if not t.clients})

    def scoring(self, kind: str) -> Scoring | None:
        return next((s for p in self.parts for s in p.scoring if s.kind == kind), None)

    def ttft(self, source: str) -> Ttft | None:
        return next((t for p in self.parts for t in p.ttft if t.source == source), None)

    def memory(self) -> Memory | None:
        return next((p.memory for p in self.parts if p.memory is not None), None)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def load(path: Path) -> Results:
        d = json.loads(path.read_text())
        return Results(
            preset=d["preset"],
            model=d["model"],
            facts=[(k, v) for k, v in d["facts"]],
            parts=[PartResult.from_json(p) for p in d["parts"]],
            floor_ms=d.get("floor_ms"),
            floor_note=d.get("floor_note", ""),
        )
