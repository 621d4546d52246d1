"""The server parts of a benchmark run: closed-loop loads against one running server.

`ServerBench` wraps a started server with the preset's request shape; `measure_server` (our
server or mlx-lm's: throughput per logprobs mode, and for ours TTFT and prompt scoring) and
`measure_memory` (our server's RSS over a long top_logprobs=20 load) fill a `PartResult`.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.loadgen import LoadConfig, LoadResult, Sender, merge, percentile, run_load
from bench.presets import (
    COMPACT,
    JSON_MODE,
    LONG_TOP,
    LONG_TOP_KEY,
    TTFT_SEED,
    CellSpec,
    ClientSetup,
    Preset,
    mode_format,
    mode_top_k,
)
from bench.results import Memory, MemoryPoint, PartResult, Scoring, Throughput, Ttft
from bench.scoring import endpoint_status, send_prefill, send_score
from bench.server import Server

now = time.monotonic


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def busy_cpu_s() -> float:
    """CPU seconds all processes have used since boot, from /proc/stat."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = f[3] + f[4]  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its finished children (load generator processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# The engine's stats line (engine/stats.py), logged every OMLX_STATS_INTERVAL_S seconds.
DECODE_STATS = re.compile(r"decode-only steps: (\d+), ([\d.]+) ms launch at ([\d.]+) rows")


def decode_stats(text: str) -> tuple[int, float, float]:
    """Over the stats lines in `text`: decode-only steps, and their launch ms and rows summed
    over those steps (each line's means weighted by its steps)."""
    steps, launch, rows = 0, 0.0, 0.0
    for m in DECODE_STATS.finditer(text):
        n = int(m[1])
        steps, launch, rows = steps + n, launch + n * float(m[2]), rows + n * float(m[3])
    return steps, launch, rows


@dataclass
class Target:
    """How to talk to one server: its name in results, the model name it serves, and whether
    it follows our logprobs contract to the letter (strict checks) or needs EOS banned."""

    name: str  # "omlx" or "mlx-lm"
    served_name: str
    strict: bool = True
    ban_token_ids: tuple[int, ...] = ()


class ServerBench:
    def __init__(self, preset: Preset, server: Server, target: Target) -> None:
        self.p = preset
        self.server = server
        self.target = target
        self.seed = 0  # bumped per run: no prompt is sent twice, so no prompt cache can help
        self.other_cpu = 0.0  # share of all cores other processes used during the last run
        # The decode-only steps our server's stats lines logged during the last run (steps,
        # launch ms and rows summed); lines fall at an interval, so a run's share is close.
        self.decode: tuple[int, float, float] = (0, 0.0, 0.0)

    def _log_size(self) -> int:
        try:
            return self.server.log_path.stat().st_size
        except (AttributeError, OSError):
            return 0

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.server.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except (AttributeError, OSError):
            return ""

    def config(self, concurrency: int, requests: int, mode: str, **changes: Any) -> LoadConfig:
        """The preset's request shape; `changes` override LoadConfig fields."""
        self.seed += 1
        cfg = LoadConfig(
            base_url=self.server.base_url,
            model=self.target.served_name,
            concurrency=concurrency,
            requests=requests,
            max_tokens=self.p.max_tokens,
            logprobs=mode_top_k(mode),
            logprobs_format=mode_format(mode),
            json_schema=mode == JSON_MODE,
            prompt_words=self.p.prompt_words,
            seed=self.seed,
            strict=self.target.strict,
            ban_token_ids=self.target.ban_token_ids,
            processes=self.p.client_processes,
        )
        return replace(cfg, **changes)

    async def load(
        self, cfg: LoadConfig, send: Sender | None = None, label: str = ""
    ) -> LoadResult:
        busy0, self0, server0, t0 = busy_cpu_s(), own_cpu_s(), self.server.cpu_s(), now()
        mark = self._log_size()
        res = await run_load(cfg, send)
        self.decode = decode_stats(self._log_since(mark))
        # Other processes on this box skew every number: measure how much CPU they took meanwhile.
        mine = own_cpu_s() - self0 + self.server.cpu_s() - server0
        other = (busy_cpu_s() - busy0 - mine) / ((now() - t0) * (os.cpu_count() or 1))
        self.other_cpu = max(0.0, other)  # clock-tick rounding can dip below zero
        compact = COMPACT if cfg.logprobs_format == "base64" else ""
        mode = label or ("off" if cfg.logprobs is None else f"top{cfg.logprobs}{compact}")
        mode = JSON_MODE if cfg.json_schema and not label else mode
        tps = res.prompt_tokens_per_s if cfg.max_tokens <= 1 else res.tokens_per_s
        err = f", {res.errors} ERRORS {res.error_samples[:1]}" if res.errors else ""
        log(
            f"  {self.target.name:<6} c={cfg.concurrency:<3} {mode:<7} n={cfg.requests:<4} "
            f"{tps:8.1f} tok/s  wall {res.wall_s:6.1f} s  p50 {res.latency_p50_s:6.2f} s  "
            f"others {self.other_cpu:4.0%}{err}"
        )
        return res

    async def warmup(self, modes: tuple[str, ...]) -> float:
        """A cold request, then one full-length request in every mode, then a short-output wave
        at every concurrency in the most expensive mode, so that batch shapes (kernels compiled
        per shape on a GPU), the cache lengths of a whole request and every mode's path have
        run before anything is timed. Returns the cold request's latency."""
        log(f"warm-up {self.target.name}:")
        short = {"max_tokens": self.p.warmup_tokens}
        cold = await self.load(self.config(1, 1, "off", **short))
        # GPU (H200) c=1: without these the first round ran 150-250 tok/s, later ones ~290.
        # The JSON mode too where it runs: its first request builds the grammar's tokenizer.
        json = (JSON_MODE,) if self.target.name == "omlx" and self.p.json_cells else ()
        for mode in (*modes, *json):
            await self.load(self.config(1, 1, mode))
        for c in sorted({c.concurrency for c in self.p.cells}):
            await self.load(self.config(c, c, modes[-1], **short))
        return cold.latency_mean_s

    async def cell(
        self,
        spec: CellSpec,
        modes: tuple[str, ...],
        shift: int,
        setup: ClientSetup | None = None,
    ) -> list[Throughput]:
        """Every mode `rounds` times. In each round the first and last modes (off and the largest
        top list: the pair a target compares) run back to back, their order alternating, so
        that the host's slow and fast phases fall on both sides of a round's pair alike
        (targets.py compares runs round by round); the modes between follow, rotated. The JSON
        mode, where the preset runs it at this concurrency, runs every round on off's other
        side (its target compares it with off). `setup`: another client set-up than the
        preset's own (no JSON mode there)."""
        json = (
            setup is None and self.target.name == "omlx" and spec.concurrency in self.p.json_cells
        )
        pair = [modes[0], modes[-1]] if len(modes) > 1 else list(modes)
        rest = [m for m in modes if m not in pair]
        modes = (*modes, JSON_MODE) if json else modes
        runs: dict[str, list[LoadResult]] = {m: [] for m in modes}
        others: dict[str, float] = {m: 0.0 for m in modes}
        decode: dict[str, list[float]] = {m: [0, 0.0, 0.0] for m in modes}
        clients: dict[str, Any] = {}
        if setup is not None:
            clients = {"processes": setup.processes, "parse_in_loop": setup.parse_in_loop}
        for r in range(spec.rounds):
            k = r + shift
            turn = k % len(rest) if rest else 0
            order = pair if k % 2 == 0 else pair[::-1]
            if json:  # next to off: before it when it leads the round, else after it
                lead = order[0] == modes[0] if len(pair) > 1 else k % 2 == 0
                order = [JSON_MODE, *order] if lead else [*order, JSON_MODE]
            if spec.full_rounds is None or r < spec.full_rounds:
                order = order + rest[turn:] + rest[:turn]
            for mode in order:
                cfg = self.config(spec.concurrency, spec.requests_per_run, mode, **clients)
                runs[mode].append(await self.load(cfg))
                others[mode] = max(others[mode], self.other_cpu)
                decode[mode] = [a + b for a, b in zip(decode[mode], self.decode)]
        cells = []
        for mode in modes:
            steps, launch, rows = decode[mode]
            res = merge(runs[mode])
            cells.append(
                Throughput(
                    self.target.name,
                    mode,
                    spec.concurrency,
                    res.config.requests,
                    len(runs[mode]),
                    res.tokens_per_s,
                    res.latency_p50_s,
                    res.errors,
                    others[mode],
                    res.error_samples,
                    [run.tokens_per_s for run in runs[mode]],
                    clients=setup.name if setup is not None else "",
                    decode_steps=int(steps),
                    host_ms=launch / steps if steps else None,
                    step_rows=rows / steps if steps else None,
                )
            )
        return cells

    async def ttft(self) -> Ttft:
        """Streaming, concurrency 1, logprobs off, the prompts bare.py gives mlx-lm generate."""
        short = self.p.warmup_tokens
        cfg = self.config(
            1, self.p.ttft_requests, "off", stream=True, seed=TTFT_SEED, max_tokens=short
        )
        res = await self.load(cfg, label="ttft")
        times = [r.ttft_s for r in res.records if r.ttft_s is not None and r.error is None]
        prompt = round(statistics.mean(r.prompt_tokens for r in res.records)) if times else None
        med = statistics.median(times) if times else float("nan")
        return Ttft("omlx", len(times), prompt, med, percentile(times, 0.9), errors=res.errors)

    async def scoring(self) -> list[Scoring]:
        """Prompt scoring (echo, max_tokens 0, logprobs 1) and our own plain prefill of prompts
        of the same length; skipped with a note while the server has no /v1/completions."""
        s = self.p.score
        status = await endpoint_status(self.server.base_url, self.target.served_name)
        if status == 404:
            note = "skipped: the server answers 404 on /v1/completions"
            return [Scoring(k, s.concurrency, 0, 0, None, note=note) for k in ("score", "prefill")]
        out = []
        kinds = (("score", send_score, 0), ("prefill", send_prefill, 1))
        # Long prompts are new shapes (kernels compiled per shape on a GPU): a warm-up wave of
        # each kind on other prompts first, so that neither side of the ratio pays for them.
        for kind, send, seed in kinds:
            new = int(kind == "prefill")
            cfg = self.config(
                s.concurrency, s.concurrency, "off", prompt_words=s.prompt_words, max_tokens=new
            )
            await self.load(replace(cfg, seed=seed + 100), send, label=f"warm-up {kind}")
        # Two rounds, alternating. Seed 0 scores the very prompts bare.py prefills; our prefill
        # gets seed 1 (then 3), so that a prefix cache could not serve it from a scoring run.
        runs: dict[str, list[LoadResult]] = {"score": [], "prefill": []}
        for r in range(2):
            for kind, send, seed in kinds if r == 0 else kinds[::-1]:
                new = int(kind == "prefill")
                cfg = self.config(
                    s.concurrency, s.requests, "off", prompt_words=s.prompt_words, max_tokens=new
                )
                runs[kind].append(await self.load(replace(cfg, seed=seed + 2 * r), send, kind))
        for kind in runs:
            res = merge(runs[kind])
            out.append(
                Scoring(kind, s.concurrency, res.config.requests, res.prompt_tokens,
                        res.prompt_tokens_per_s, res.errors,
                        "; ".join(res.error_samples[:2]))
            )  # fmt: skip
        return out


async def measure_server(b: ServerBench, part: PartResult, modes: tuple[str, ...]) -> None:
    await b.warmup(modes)
    for i, spec in enumerate(b.p.cells):
        if b.target.name != "omlx":
            spec = spec.capped(b.p.peer_rounds)
        part.throughput += await b.cell(spec, modes, shift=i)
    if b.target.name == "omlx":
        for setup in b.p.client_setups:
            # off, then (compact) the largest top list as base64, then that list as JSON: the
            # cell's pair is still off and the JSON list; base64 runs every round between
            ran = (modes[0], *((modes[-1] + COMPACT,) if setup.compact else ()), modes[-1])
            for i, spec in enumerate(setup.cells):
                part.throughput += await b.cell(spec, ran, shift=i, setup=setup)
        if b.p.long_top_cell is not None:  # off, the long list as base64, then as JSON
            top = f"top{LONG_TOP}"
            setup = ClientSetup(LONG_TOP_KEY, b.p.client_processes, False, ())
            ran = ("off", top + COMPACT, top)
            part.throughput += await b.cell(b.p.long_top_cell, ran, shift=0, setup=setup)
        part.ttft.append(await b.ttft())
        part.scoring += await b.scoring()


async def measure_memory(b: ServerBench, part: PartResult) -> None:
    """RSS after a warm-up, then after each slice of the measured requests."""
    m = b.p.memory
    mode = f"top{m.top_k}"
    kw = {"max_tokens": m.max_tokens, "prompt_words": m.prompt_words}
    await b.load(b.config(m.concurrency, m.warmup_requests, mode, **kw), label="warm-up")
    mem = Memory(m.concurrency, m.max_tokens, m.top_k, b.server.rss_mib())
    log(f"  RSS after warm-up {mem.warm_rss_mib:.1f} MiB")
    done = 0
    for i in range(m.readings):
        n = m.requests * (i + 1) // m.readings - done
        res = await b.load(b.config(m.concurrency, n, mode, **kw))
        done += n
        mem.errors += res.errors
        mem.points.append(MemoryPoint(done, b.server.rss_mib()))
        log(f"  RSS after {done} requests {mem.points[-1].rss_mib:.1f} MiB")
    part.memory = mem
