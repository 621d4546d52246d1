"""Markdown for one preset's results: the throughput matrix, the targets, scoring, TTFT,
memory, the machine and the exact commands. `section` is what lands between the markers."""

from __future__ import annotations

import statistics

from bench.presets import COMPACT, LONG_TOP, LONG_TOP_KEY, Preset
from bench.report import begin_marker, end_marker
from bench.results import PartResult, Results, Throughput
from bench.targets import Check, paired_ratios


def _tps(t: Throughput | None) -> str:
    if t is None:
        return "–"
    return f"{t.tokens_per_s:.1f}" + (f" (**{t.errors} errors**)" if t.errors else "")


def _x(num: Throughput | None, den: Throughput | None) -> str:
    if num is None or den is None or den.tokens_per_s <= 0:
        return "–"
    return f"{num.tokens_per_s / den.tokens_per_s:.2f}"


def throughput_table(res: Results) -> str:
    head = (
        "| concurrency | ours off | ours top0 | ours top5 | ours top20 | top20 / off "
        "| mlx-lm off | mlx-lm top5 | ours / mlx-lm, top5 | BatchGenerator | ours off / BG "
        "| other CPU |"
    )
    lines = [head, "|" + "---:|" * 12]
    for c in res.concurrencies():
        ours = {m: res.throughput("omlx", m, c) for m in ("off", "top0", "top5", "top20")}
        peer = {m: res.throughput("mlx-lm", m, c) for m in ("off", "top5")}
        bare = res.throughput("batchgen", "off", c)
        cells = [t for t in (*ours.values(), *peer.values(), bare) if t is not None]
        other = max((t.other_cpu for t in cells), default=0.0)
        lines.append(
            f"| {c} | {_tps(ours['off'])} | {_tps(ours['top0'])} | {_tps(ours['top5'])} "
            f"| {_tps(ours['top20'])} | {_x(ours['top20'], ours['off'])} "
            f"| {_tps(peer['off'])} | {_tps(peer['top5'])} | {_x(ours['top5'], peer['top5'])} "
            f"| {_tps(bare)} | {_x(ours['off'], bare)} | {other:.0%} |"
        )
    return "\n".join(lines)


def targets_table(checks: list[Check]) -> str:
    lines = ["| target | measured | goal | met |", "|---|---:|---:|---|"]
    for c in checks:
        met = "not measured" if c.met is None else ("yes" if c.met else "**no**")
        note = f" ({c.note})" if c.note else ""
        lines.append(f"| {c.name} | {c.value} | {c.goal} | {met}{note} |")
    return "\n".join(lines)


def rounds_table(res: Results) -> list[str]:
    """Our modes against logprobs off round by round (each round's runs close in time); top0,
    which adds almost nothing to a step, shows how far the host alone moves a ratio."""
    lines = []
    for c in res.concurrencies():
        off = res.throughput("omlx", "off", c)
        for mode in ("top0", "top20", "json"):
            on = res.throughput("omlx", mode, c)
            ratios = paired_ratios(on, off) if on is not None and off is not None else []
            if ratios:
                each = " ".join(f"{r:.2f}" for r in ratios)
                lines.append(f"| {c} | {mode} / off | {statistics.median(ratios):.2f} | {each} |")
    if not lines:
        return []
    head = ["", "| concurrency | ratio | median | round by round |", "|---:|---|---:|---|"]
    return head + lines


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _median_ratio(on: Throughput | None, off: Throughput | None) -> str:
    """top20 / off: the median of the rounds' ratios, else the pooled one."""
    ratios = paired_ratios(on, off) if on is not None and off is not None else []
    return f"{statistics.median(ratios):.2f}" if ratios else _x(on, off)


def host_table(res: Results, p: Preset) -> list[str]:
    """Our server per client set-up: top 20 against off, and the host's launch time per
    decode-only step (its stats lines); on a GPU, a step against the device's floor."""
    setups = [p.clients] + [s.name for s in p.client_setups]
    floor = res.floor_ms
    lines = []
    for i, name in enumerate(setups):
        key = "" if i == 0 else name
        ours = [t for x in res.parts for t in x.throughput if t.target == "omlx"]
        cs = sorted({t.concurrency for t in ours if t.clients == key})
        for c in [c for c in cs if c >= 32] or cs[-1:]:  # where the host bounds a step
            off = res.throughput("omlx", "off", c, key)
            top = res.throughput("omlx", "top20", c, key)
            compact = res.throughput("omlx", "top20" + COMPACT, c, key)
            if off is None:
                continue
            step = None  # wall time per decode step: its rows over the run's tokens/s
            if off.step_rows and off.tokens_per_s > 0:
                step = 1e3 * off.step_rows / off.tokens_per_s
            vs = "–"
            if floor and step is not None and off.host_ms is not None:
                vs = f"{step / floor:.1f}x, {off.host_ms / floor:.1f}x"
            rows = "–" if off.step_rows is None else f"{off.step_rows:.1f}"
            base64 = _median_ratio(compact, off) if compact else "–"
            lines.append(
                f"| {name} | {c} | {_tps(off)} | {_tps(top)} | {_median_ratio(top, off)} "
                f"| {base64} | {_ms(off.host_ms)} | {_ms(top.host_ms if top else None)} "
                f"| {rows} | {_ms(step)} | {vs} |"
            )
    if not lines:
        return []
    where = f" ({floor:.3f} ms: {res.floor_note})" if floor else ""
    head = [
        "",
        "| clients | concurrency | off tok/s | top20 tok/s | top20 / off | top20 base64 / off "
        "| host ms per decode step, off | same, top20 | rows per step | step ms, off | step, "
        f"host / device floor{where} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return head + lines


def long_top_table(res: Results, p: Preset) -> list[str]:
    """What the long top list costs (presets.LONG_TOP, as distillation reads it): its cell's
    throughput against off, as JSON and as base64."""
    spec = p.long_top_cell
    if spec is None:
        return []
    c, top = spec.concurrency, f"top{LONG_TOP}"
    off = res.throughput("omlx", "off", c, LONG_TOP_KEY)
    on = res.throughput("omlx", top, c, LONG_TOP_KEY)
    compact = res.throughput("omlx", top + COMPACT, c, LONG_TOP_KEY)
    if off is None:
        return []
    return [
        "",
        f"| concurrency | off tok/s | {top} tok/s | {top} / off | {top} base64 tok/s "
        f"| {top} base64 / off |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {c} | {_tps(off)} | {_tps(on)} | {_median_ratio(on, off)} | {_tps(compact)} "
        f"| {_median_ratio(compact, off)} |",
    ]


def detail_tables(res: Results, p: Preset | None = None) -> list[str]:
    out: list[str] = rounds_table(res)
    if p is not None:
        out += host_table(res, p)
        out += long_top_table(res, p)
    scoring = [s for p in res.parts for s in p.scoring]
    if scoring:
        out += [
            "",
            "| prompt load | concurrency | requests | prompt tokens | prompt tok/s | note |",
        ]
        out += ["|---|---:|---:|---:|---:|---|"]
        names = {"score": "ours: echo, max_tokens 0, logprobs 1", "prefill": "ours: max_tokens 1",
                 "bare": "bare BatchGenerator, 1 token"}  # fmt: skip
        for s in scoring:
            tps = "–" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}"
            errs = f"**{s.errors} errors** " if s.errors else ""
            out.append(
                f"| {names.get(s.kind, s.kind)} | {s.concurrency} | {s.requests} "
                f"| {s.prompt_tokens} | {tps} | {errs}{s.note} |"
            )
    ttft = [t for p in res.parts for t in p.ttft]
    if ttft:
        out += ["", "| TTFT, concurrency 1 | requests | prompt tokens | median (ms) | p90 (ms) "
                "| first token, text or not (ms) |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for t in ttft:
            name = "ours, streaming HTTP" if t.source == "omlx" else "mlx-lm stream_generate"
            first = "–" if t.first_token_median_s is None else f"{t.first_token_median_s * 1e3:.1f}"
            out.append(
                f"| {name} | {t.requests} | {t.prompt_tokens} | {t.median_s * 1e3:.1f} "
                f"| {t.p90_s * 1e3:.1f} | {first} |"
            )
    out += quantized_table(res)
    mem = res.memory()
    if mem is not None:
        out += ["", f"Memory soak: concurrency {mem.concurrency}, {mem.max_tokens} new tokens, "
                f"top_logprobs {mem.top_k}; RSS after warm-up {mem.warm_rss_mib:.1f} MiB, then "
                + ", ".join(f"{p.rss_mib:.1f} after {p.requests_done}" for p in mem.points)
                + (f"; **{mem.errors} errors**" if mem.errors else "") + "."]  # fmt: skip
    return out


def quantized_table(res: Results) -> list[str]:
    """The quantized part (quantized.py): the 4-bit model and the float32 one, run by run."""
    part = res.part("quantized")
    if part is None or not part.throughput:
        return []
    names = {"4bit": "4-bit (`mlx_lm convert -q`), `--dtype auto`", "float32": "float32"}
    out = ["", "| random model, logprobs off | concurrency | completion tok/s | runs (tok/s) |",
           "|---|---:|---:|---|"]  # fmt: skip
    for t in part.throughput:
        runs = " ".join(f"{r:.1f}" for r in t.run_tokens_per_s)
        out.append(f"| {names.get(t.target, t.target)} | {t.concurrency} | {_tps(t)} | {runs} |")
    return out


def _commands(parts: list[PartResult]) -> list[str]:
    out = ["Commands (each part's runner command, then the server or subprocess it started):", ""]
    for p in parts:
        facts = [f"finished {p.finished}, {p.seconds / 60:.1f} min"]
        if p.startup_s is not None:
            facts.append(f"server ready in {p.startup_s:.1f} s")
        if p.blas:
            facts.append(f"BLAS: {p.blas}")
        if p.server_cores is not None:
            facts.append(f"server used {p.server_cores:.2f} cores while measured")
        facts.append(f"{len(p.problems)} server log problem lines")
        out += [f"- `{p.part}`: " + "; ".join(facts) + ".", "  ```", f"  {p.runner_cmd}"]
        out += ([f"  {p.server_cmd}"] if p.server_cmd else []) + ["  ```"]
        out += [f"  {n}" for n in p.notes]
    return out + [""]


def section(res: Results, p: Preset, checks: list[Check]) -> str:
    when = max((x.finished for x in res.parts), default="")
    out = [
        begin_marker(res.preset),
        f"## Preset `{res.preset}` ({when})",
        "",
        *[f"- {k}: {v}" for k, v in res.facts],
        f"- model: {res.model}",
        "",
        *_commands(res.parts),
        f"Non-streaming chat completions, {p.max_tokens} new tokens per request (`ignore_eos`; "
        "mlx-lm's server, which has no `ignore_eos`, gets EOS banned with `logit_bias` -100), "
        f"prompts of about {p.prompt_words} random words, distinct per request, temperature 0. "
        "Completion tokens/s over wall time, summed over a mode's runs. A cell runs in rounds: "
        "in each, logprobs off and the largest top list run back to back (their order "
        "alternating), then the other modes (in a cell's first rounds only, where the preset "
        "says so); with three rounds or more, a top20/off target is "
        "the median of the rounds' ratios (listed after the targets), the pooled ratio is in "
        "the table. "
        "BatchGenerator: bare mlx-lm in-process, chat-templated prompts in the same runs as "
        "ours (as many requests a run; as many runs as mlx-lm's server gets), completion "
        "batch = concurrency. Other "
        "CPU: the largest share of the machine that other processes took during a run of that "
        "row (above ~10%, distrust the row). "
        f"Clients: {p.clients}; the last table also runs off and top 20 with other client "
        "set-ups, and gives our engine's host time per decode step (its launch: graph building "
        "and queueing, per step that sampled rows and prefilled nothing, from its stats lines "
        "logged each second during the runs), and a step's wall time (rows per step over "
        "tok/s) and host time against the device's floor (weights read once at its "
        "bandwidth).",
        "",
        throughput_table(res),
        "",
        targets_table(checks),
        *detail_tables(res, p),
        end_marker(res.preset),
    ]
    return "\n".join(out) + "\n"
