"""The quantized-model row of `make bench`: a random-weight llama (randmodel.py) quantized by
`mlx_lm convert -q`, served by our server with `--dtype auto`, against the same model in
float32, completion tokens/s at one concurrency with logprobs off.

On the CPU `auto` dequantizes a quantized model to float32 once at load (models/dtype.py):
MLX's CPU quantized matmul is about ten times slower than OpenBLAS's float32 one
(bench/experiments/quantized_cpu.py), so the 4-bit model should serve about as fast as the
float32 one. Both servers run at once and the rounds alternate between them, so that the host's
slow and fast phases fall on both sides alike; the ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bench.measure import ServerBench, Target, log
from bench.presets import CellSpec, Preset
from bench.results import PartResult, Throughput
from bench.server import REPO, free_port, omlx_command, start_server

TARGETS = ("4bit", "float32")  # the Throughput targets of this part: quantized, then float32


def model_dirs(p: Preset, cache: Path, tokenizer_from: Path, shown: Callable) -> dict[str, Path]:
    """The float32 random model and its quantized copy, built once in `cache`."""
    spec = p.quantized
    assert spec is not None
    dense = cache / f"rand-{spec.size}-float32"
    if not (dense / "model.safetensors").exists():
        cmd = [sys.executable, "-m", "bench.randmodel", "--out", str(dense)]
        cmd += ["--tokenizer-from", str(tokenizer_from), "--size", spec.size, "--dtype", "float32"]
        log(f"building the random model: {shown(cmd)}")
        subprocess.run(cmd, cwd=REPO, check=True)
    quantized = cache / f"rand-{spec.size}-{spec.bits}bit"
    if not (quantized / "config.json").exists():
        cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(dense)]
        cmd += ["--mlx-path", str(quantized), "-q", "--q-bits", str(spec.bits)]
        cmd += ["--q-group-size", str(spec.group_size)]
        log(f"quantizing it: {shown(cmd)}")
        subprocess.run(cmd, cwd=REPO, check=True)
    return {"4bit": quantized, "float32": dense}


def _merged(cells: list[Throughput]) -> Throughput:
    """One target's rounds as one cell: every run's tokens/s, pooled over equal-sized runs."""
    runs = [r for t in cells for r in t.run_tokens_per_s]
    pooled = len(runs) / sum(1 / r for r in runs) if runs and all(r > 0 for r in runs) else 0.0
    p50s = [t.latency_p50_s for t in cells if t.latency_p50_s is not None]
    return replace(
        cells[0],
        requests=sum(t.requests for t in cells),
        runs=len(runs),
        tokens_per_s=pooled,
        latency_p50_s=statistics.median(p50s) if p50s else None,
        errors=sum(t.errors for t in cells),
        other_cpu=max(t.other_cpu for t in cells),
        error_samples=[s for t in cells for s in t.error_samples][:3],
        run_tokens_per_s=runs,
    )


async def _measure(benches: dict[str, ServerBench], cell: CellSpec) -> list[Throughput]:
    for b in benches.values():
        await b.warmup(("off",))
    got: dict[str, list[Throughput]] = {t: [] for t in benches}
    for r in range(cell.rounds):
        order = list(benches) if r % 2 == 0 else list(benches)[::-1]
        for name in order:
            got[name] += await benches[name].cell(replace(cell, rounds=1), ("off",), shift=0)
    return [_merged(got[name]) for name in benches]


def quantized_part(
    p: Preset, runner_cmd: str, cache: Path, tokenizer_from: Path, shown: Callable
) -> PartResult:
    spec = p.quantized
    assert spec is not None
    t0 = time.perf_counter()
    dirs = model_dirs(p, cache, tokenizer_from, shown)
    cell = CellSpec(spec.concurrency, spec.concurrency, spec.rounds)
    bench_preset = replace(p, cells=(cell,))
    servers, benches, cmds = [], {}, []
    try:
        for name, d in dirs.items():
            port = free_port()
            cmd = omlx_command(port, str(d), p.max_num_seqs)  # --dtype auto, the default
            log(f"starting: {shown(cmd)}")
            server = start_server(cmd, port)
            servers.append(server)
            cmds.append(shown(cmd))
            log(f"{name} ready in {server.startup_s:.1f} s; {_weights_line(server.log_text())}")
            benches[name] = ServerBench(bench_preset, server, Target(name, d.name))
        throughput = asyncio.run(_measure(benches, cell))
    finally:
        for s in servers:
            s.stop()
    result = PartResult(
        "quantized", "", 0.0, runner_cmd, "\n  ".join(cmds),
        servers[0].startup_s, servers[0].blas_line(),
    )  # fmt: skip
    result.throughput = throughput
    result.problems = [line for s in servers for line in s.log_problems()]
    result.notes.append(f"The 4-bit server's weights: {_weights_line(servers[0].log_text())}.")
    result.seconds = time.perf_counter() - t0
    return result


def _weights_line(log_text: str) -> str:
    """The server's own account of what it did to the weights (models/loader.py logs it)."""
    lines = [x for x in log_text.splitlines() if "weights:" in x]
    return lines[-1].split("weights:", 1)[1].strip() if lines else "no weights line in the log"
