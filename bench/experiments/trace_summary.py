"""Summarize a server log's step trace (OMLX_STEP_TRACE=1, omlx_logprobs/engine/stats.py): for
the steps of its last request (those after the last gap of over a second), their count, and the
mean and median of the period between step ends, of the launch, of the completion and of the
queueing, in ms.

    python bench/experiments/trace_summary.py /tmp/bench-server-*.log
"""

from __future__ import annotations

import statistics
import sys


def main() -> None:
    for path in sys.argv[1:]:
        rows = []
        for line in open(path, errors="replace"):
            if "step-trace:" in line:
                f = line.split("step-trace:")[1].split()
                rows.append((float(f[0]), float(f[1]), float(f[2]), float(f[5])))
        if not rows:
            continue
        start = max(
            (i for i in range(1, len(rows)) if rows[i][0] - rows[i - 1][0] > 1.0), default=0
        )
        last = rows[start:]
        periods = [1e3 * (b[0] - a[0]) for a, b in zip(last, last[1:])]
        cols = {"period": periods, "launch": [r[1] for r in last], "complete": [r[2] for r in last],
                "queue": [r[3] for r in last]}  # fmt: skip
        parts = [
            f"{k} {statistics.mean(v):.2f}/{statistics.median(v):.2f}" for k, v in cols.items() if v
        ]
        print(f"{path}: {len(last)} steps; mean/median ms: " + ", ".join(parts))


if __name__ == "__main__":
    main()
