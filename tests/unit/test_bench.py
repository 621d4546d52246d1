"""The benchmark's own verdicts (bench/'s modules, imported as the package they are): a cell's
rounds run each target's pair back to back, and a top20/off target reads the median of the
rounds' ratios, with the pooled ratio beside it."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.loadgen import LoadConfig, LoadResult, RequestRecord, check_body, summarize
from bench.measure import ServerBench, Target, decode_stats
from bench.presets import CPU, GPU, JSON, CellSpec
from bench.report import device_floor
from bench.results import PartResult, Results, Throughput
from bench.targets import evaluate
from omlx_logprobs.engine.stats import StepStats
from omlx_logprobs.runner.step import DeviceTime


def test_a_round_runs_off_and_top20_back_to_back_in_alternating_order() -> None:
    bench = ServerBench(GPU, SimpleNamespace(base_url="http://127.0.0.1:1/v1"), Target("omlx", "m"))
    order: list[str] = []

    async def load(cfg: LoadConfig, *_: Any, **__: Any) -> LoadResult:
        mode = "off" if cfg.logprobs is None else f"top{cfg.logprobs}"
        order.append(mode)
        speed = 100.0 if mode == "off" else 90.0  # tokens per second of wall time
        rec = RequestRecord(1.0, completion_tokens=cfg.max_tokens)
        return summarize(cfg, [rec] * cfg.requests, cfg.requests * cfg.max_tokens / speed)

    bench.load = load  # type: ignore[method-assign]
    modes = ("off", "top0", "top5", "top20")
    cells = asyncio.run(bench.cell(CellSpec(8, 8, 4), modes, shift=0))
    rounds = [order[i : i + 4] for i in range(0, 16, 4)]
    assert [r[:2] for r in rounds] == [["off", "top20"], ["top20", "off"]] * 2
    assert all(sorted(r[2:]) == ["top0", "top5"] for r in rounds)
    top20 = next(c for c in cells if c.mode == "top20")
    assert top20.run_tokens_per_s == [90.0] * 4 and top20.runs == 4
    # Later rounds may run the pair alone; a peer's cell is capped, full rounds with it.
    order.clear()
    cells = asyncio.run(bench.cell(CellSpec(8, 8, 4, full_rounds=2), modes, shift=0))
    assert order[8:] == ["off", "top20", "top20", "off"]
    assert sorted(order[:8]) == sorted(modes * 2)
    runs = {c.mode: c.runs for c in cells}
    assert runs == {"off": 4, "top0": 2, "top5": 2, "top20": 4}
    assert CellSpec(8, 8, 4, full_rounds=3).capped(2) == CellSpec(8, 8, 2, full_rounds=2)
    assert CellSpec(8, 8, 4).capped(None) == CellSpec(8, 8, 4)


def test_the_json_row_runs_beside_off_every_round_and_reads_its_median() -> None:
    """Where a preset runs the JSON-schema mode (c=8 of `cpu`), it runs in every round on
    off's other side, its requests carry the schema, and its target is the median of the
    rounds' json/off ratios against 0.8."""
    assert 8 in CPU.json_cells and JSON.json_cells == (8,)
    sent: list[tuple[str, bool]] = []

    async def load(cfg: LoadConfig, *_: Any, **__: Any) -> LoadResult:
        mode = "json" if cfg.json_schema else ("off" if cfg.logprobs is None else "top")
        sent.append((mode, cfg.json_schema))
        speed = {"off": 100.0, "json": 85.0}.get(mode, 90.0)
        rec = RequestRecord(1.0, completion_tokens=cfg.max_tokens)
        return summarize(cfg, [rec] * cfg.requests, cfg.requests * cfg.max_tokens / speed)

    base = SimpleNamespace(base_url="http://127.0.0.1:1/v1")
    for preset, modes, size in ((CPU, ("off", "top20"), 3), (JSON, ("off",), 2)):
        sent.clear()
        bench = ServerBench(preset, base, Target("omlx", "m"))
        bench.load = load  # type: ignore[method-assign]
        cells = asyncio.run(bench.cell(CellSpec(8, 8, 4), modes, shift=0))
        rounds = [[m for m, _ in sent[i : i + size]] for i in range(0, 4 * size, size)]
        for r in rounds:  # json beside off in each round
            assert abs(r.index("json") - r.index("off")) == 1
        assert all(json_schema == (m == "json") for m, json_schema in sent)
        res = Results(preset.name, "m", parts=[PartResult("omlx", "now", 1.0, "cmd")])
        res.parts[0].throughput = cells
        [check] = [c for c in evaluate(res, preset) if c.name == "ours JSON schema / ours off, c=8"]
        assert check.value == "0.85x" and check.met and check.note.startswith("median of 4")
    peer = ServerBench(CPU, base, Target("mlx-lm", "m"))
    peer.load = load  # type: ignore[method-assign]
    sent.clear()
    asyncio.run(peer.cell(CellSpec(8, 8, 2), ("off", "top5"), shift=0))
    assert all(m != "json" for m, _ in sent)  # never on mlx-lm's server


def throughput(mode: str, runs: list[float]) -> Throughput:
    pooled = len(runs) / sum(1 / r for r in runs)  # equal tokens a run: the harmonic mean
    return Throughput("omlx", mode, 32, 64 * len(runs), len(runs), pooled, None, 0, 0.0, [], runs)


def test_the_top20_target_reads_the_median_of_paired_rounds() -> None:
    # Round 2 ran off in a fast phase of the host: it sinks the pooled ratio, not the median.
    off = throughput("off", [100.0, 100.0, 160.0, 100.0, 100.0])
    top20 = throughput("top20", [97.0, 96.0, 98.0, 97.0, 95.0])
    res = Results("gpu", "m", parts=[PartResult("omlx", "now", 1.0, "cmd")])
    res.parts[0].throughput = [off, top20]
    [check] = [c for c in evaluate(res, GPU) if c.name == "ours top20 / ours off, c=32"]
    assert check.value == "0.96x" and check.met
    assert check.note.startswith("median of 5 rounds' ratios (0.61-0.97); pooled 0.89x")
    # Fewer than three rounds: the pooled ratio decides.
    res.parts[0].throughput = [throughput("off", [100.0, 160.0]), throughput("top20", [97, 98])]
    [check] = [c for c in evaluate(res, GPU) if c.name == "ours top20 / ours off, c=32"]
    assert check.value == "0.79x" and check.met is False and not check.note


def test_a_body_is_checked_after_the_run_and_a_wrong_one_is_an_error() -> None:
    """The load generator keeps a non-streamed body until its clock stops; the check then
    reads its counts, and a top list of the wrong length is still an error."""
    cfg = LoadConfig("http://127.0.0.1:1/v1", "m", max_tokens=2, logprobs=2)

    def body(top: int) -> bytes:
        entry = {"token": "a", "bytes": [97], "logprob": -0.5}
        entries = [{**entry, "top_logprobs": [entry] * top}] * 2
        choice = {"logprobs": {"content": entries}}
        usage = {"completion_tokens": 2, "prompt_tokens": 7}
        return json.dumps({"choices": [choice], "usage": usage}).encode()

    good, bad, broken = (RequestRecord(0.1, body=b) for b in (body(2), body(1), b"{"))
    for rec in (good, bad, broken):
        check_body(rec, cfg)
        assert rec.body is None
    assert (good.error, good.completion_tokens, good.prompt_tokens) == (None, 2, 7)
    assert bad.error == "entry 0: top_logprobs has 1 items, expected 2"
    assert broken.error is not None and broken.error.startswith("JSONDecodeError")


def test_the_host_time_per_decode_step_is_read_from_the_engine_stats_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only steps that sampled rows and prefilled nothing count; two lines add up, each
    weighted by its steps."""
    stats = StepStats(interval_s=1e9)
    with caplog.at_level(logging.INFO, logger="omlx_logprobs"):
        for rows, prefill, launch in ((64, 0, 0.002), (64, 0, 0.004), (60, 100, 0.010)):
            stats.add(rows, prefill, 0, launch, 0.0, DeviceTime())
        stats.flush()
        stats.add(32, 0, 0, 0.003, 0.0, DeviceTime())
        stats.add(0, 0, 0, 0.001, 0.0, DeviceTime())  # nothing sampled: not a decode step
        stats.flush()
    steps, launch_ms, rows = decode_stats(caplog.text)
    assert steps == 3
    assert launch_ms == pytest.approx(9.0)
    assert rows == pytest.approx(160.0)


def test_the_device_floor_reads_the_weights_at_the_gpus_bandwidth(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 3_350_000)
    (tmp_path / "config.json").write_text("{}")  # not a weight
    floor, note = device_floor(tmp_path, "NVIDIA H100 80GB HBM3, 81559 MiB, 580.1", None)
    assert floor == pytest.approx(1e-3) and "3.35 TB/s" in note  # ms: 3.35 MB at 3.35 TB/s
    assert device_floor(tmp_path, "NVIDIA H200, 143771 MiB", None)[0] == pytest.approx(3.35 / 4.8e3)
    assert device_floor(tmp_path, "NVIDIA H100 PCIe, 81559 MiB", None)[0] == pytest.approx(1.675e-3)
    assert device_floor(tmp_path, None, None) == (None, "")  # the CPU box
    assert device_floor(tmp_path, None, 1000.0)[0] == pytest.approx(3.35e-3)


def test_the_speculation_bench_reads_the_issue_s_targets() -> None:
    """bench/speculation.py's last lines: each target's ratio against off, met or not; a target
    whose runs are missing is not claimed."""
    from bench.speculation import targets

    runs = {
        "ours-off/edit": {"tok_s": 100.0},
        "ours-prediction/edit": {"tok_s": 350.0},
        "ours-off/chats": {"tok_s": 128.0},
        "ours-draft/chats": {"tok_s": 160.0},
    }
    tput = {"ours-off": 1000.0, "ours-lookup": 990.0, "ours-draft": 900.0}
    assert targets({"runs": runs, "throughput": tput}) == [
        "target: editing with a prediction: 3.50x of off (goal 2.0x): met",
        "target: free chat (chats) with the draft model: 1.25x of off (goal 1.4x): NOT MET",
        "target: throughput with lookup: 0.99x of off (goal 0.95x): met",
        "target: throughput with draft: 0.90x of off (goal 0.95x): NOT MET",
    ]
