"""Where a closed-loop run's time goes, from the engine's step trace and the load generator's
request records: tokens/s = rows a step x steps a second, and a second of wall time is spent in
steps or in gaps (the engine idle between waves, or waiting on arrivals).

    OMLX_STEP_TRACE=1 python -m omlx_logprobs.cli serve --log-level info ... 2> /tmp/server.log
    python -m bench.loadgen ... --records /tmp/run1.jsonl   # one file per run
    python -m bench.waves /tmp/server.log /tmp/run1.jsonl /tmp/run2.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Step:
    end: float  # perf_counter when the step's bookkeeping ended
    launch_ms: float
    complete_ms: float
    rows: int
    prefill_tokens: int
    queue_ms: float = 0.0  # of launch_ms: in async_eval
    aside_ms: float = 0.0  # the last step's processing on the second thread
    lag_ms: float = 0.0  # how long that ran past the launch's async_eval


def read_steps(path: Path) -> list[Step]:
    """The server log's step-trace lines (older logs lack the last three fields)."""
    steps = []
    for line in path.read_text().splitlines():
        if "step-trace: " not in line:
            continue
        end, launch, complete, rows, prefill, *more = line.split("step-trace: ", 1)[1].split()
        extra = [float(x) for x in more[:3]]
        steps.append(
            Step(float(end), float(launch), float(complete), int(rows), int(prefill), *extra)
        )
    return sorted(steps, key=lambda s: s.end)


def quantiles(xs: list[float]) -> str:
    """p10/p50/p90 as text."""
    if len(xs) < 2:
        return "/".join([f"{xs[0] if xs else 0.0:.1f}"] * 3)
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return f"{q[0]:.1f}/{statistics.median(xs):.1f}/{q[-1]:.1f}"


def max_overlap(records: list[dict]) -> int:
    """The most requests in flight at once: the load's concurrency."""
    events = sorted(
        [(r["sent_at"], 1) for r in records]
        + [(r["sent_at"] + r["latency_s"], -1) for r in records]
    )
    level = top = 0
    for _, d in events:
        level += d
        top = max(top, level)
    return top


def summary(steps: list[Step], records: list[dict], gap_ms: float) -> str:
    t0 = min(r["sent_at"] for r in records)
    t1 = max(r["sent_at"] + r["latency_s"] for r in records)
    run = [s for s in steps if t0 <= s.end <= t1]
    dts = [(b.end - a.end) * 1e3 for a, b in zip(run, run[1:], strict=False)]
    busy = [d for d in dts if d <= gap_ms] or [0.0]
    gaps = [d for d in dts if d > gap_ms]
    rows = sum(s.rows for s in run)
    decode = [s for s in run if s.prefill_tokens == 0 and s.rows]
    prefill = [s for s in run if s.prefill_tokens]
    tokens = sum(r["completion_tokens"] for r in records)
    # A worker's time outside its requests: the client's own work, the start and the tail.
    outside = max_overlap(records) * (t1 - t0) - sum(r["latency_s"] for r in records)
    first = (run[0].end - t0) * 1e3 if run else 0.0
    return (
        f"{tokens / (t1 - t0):8.0f} tok/s  wall {(t1 - t0) * 1e3:7.0f} ms  steps {len(run):4d}  "
        f"rows/step {rows / max(len(run), 1):5.1f}  step ms median "
        f"{statistics.median(busy):5.2f} mean {statistics.fmean(busy):5.2f}  "
        f"gaps {len(gaps):3d} = {sum(gaps):6.0f} ms  first step {first:5.0f} ms  "
        f"prefill steps {len(prefill):3d} "
        f"({sum(s.launch_ms + s.complete_ms for s in prefill):5.0f} ms host)  "
        f"decode launch p10/50/90 {quantiles([s.launch_ms for s in decode])} "
        f"complete {statistics.fmean([s.complete_ms for s in decode] or [0]):5.2f} ms  "
        f"client {outside / len(records) * 1e3:5.1f} ms/request"
        f"{aside_summary(decode)}"
    )


def aside_summary(decode: list[Step]) -> str:
    """Decode steps' async_eval time, the processing beside it, and how often (and by how
    much) that processing outlasted the async_eval (the launch then waits for the GIL)."""
    if not decode or not any(s.aside_ms for s in decode):
        return ""
    late = [s.lag_ms for s in decode if s.lag_ms > 0]
    return (
        f"  queue p10/50/90 {quantiles([s.queue_ms for s in decode])}  aside "
        f"{quantiles([s.aside_ms for s in decode])}  ran past the queueing in "
        f"{100 * len(late) / len(decode):3.0f}% of steps, by {quantiles(late or [0.0])} ms"
    )


def boundaries(steps: list[Step], records: list[dict], conc: int) -> list[str]:
    """Each wave's end as a timeline, ms from its first response's arrival: the engine's last
    step before it, the responses arriving (median, last), the client done with them (median),
    the next wave's requests sent (first, median, last), its first prefill step, and the first
    step after that at 90% of the wave's rows."""
    recs = sorted(records, key=lambda r: r["sent_at"])
    waves = [recs[i : i + conc] for i in range(0, len(recs), conc)]
    lines = []
    for wave, nxt in zip(waves, waves[1:], strict=False):
        got = sorted(r["sent_at"] + r["latency_s"] for r in wave)
        r0 = got[0]
        done = sorted(r["done_at"] for r in wave)
        sent = sorted(r["sent_at"] for r in nxt)
        last = max((s.end for s in steps if s.end <= r0), default=r0)
        later = [s for s in steps if s.end > r0]
        pre = next((s.end for s in later if s.prefill_tokens), r0)
        full = next((s.end for s in later if s.end > pre and s.rows >= 0.9 * len(nxt)), r0)
        at = {
            "last step": last, "arrived p50": got[len(got) // 2], "last": got[-1],
            "client done p50": done[len(done) // 2], "sent first": sent[0],
            "p50": sent[len(sent) // 2], "last ": sent[-1], "first prefill": pre,
            "rows back": full,
        }  # fmt: skip
        lines.append("  " + "  ".join(f"{k.strip()} {(t - r0) * 1e3:6.1f}" for k, t in at.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log", type=Path, help="the server's log, run with OMLX_STEP_TRACE=1")
    ap.add_argument("runs", type=Path, nargs="+", help="--records files, one per run")
    ap.add_argument("--gap-ms", type=float, default=25.0, help="a longer interval is a gap")
    ap.add_argument("--concurrency", type=int, help="print each wave's end (closed loop)")
    a = ap.parse_args(argv)
    steps = read_steps(a.log)
    for path in a.runs:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        print(f"{path.name:<24} {summary(steps, records, a.gap_ms)}")
        if a.concurrency:
            print("\n".join(boundaries(steps, records, a.concurrency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
