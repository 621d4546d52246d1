"""Issue 5's targets, evaluated on one run's results: every one is reported, met or not, and
one that was not measured says so rather than disappearing."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.presets import Preset
from bench.results import Results, Throughput

TOP20_GOAL = 0.95  # top_logprobs 20 against logprobs off, every concurrency
BATCHGEN_GOAL = 0.8  # our server without logprobs against bare BatchGenerator, c=64
JSON_GOAL = 0.8  # a JSON schema on every request against none (logprobs off), c=8
SCORING_GOAL = 0.8  # prompt scoring against plain prefill of the same tokens
TTFT_GOAL_MS = 10.0  # our TTFT minus mlx-lm generate's, concurrency 1
MEMORY_GOAL = 0.05  # RSS growth over the memory soak, past warm-up
QUANTIZED_GOAL = 0.9  # a 4-bit model served with --dtype auto against itself in float32


@dataclass
class Check:
    name: str
    value: str  # as measured, e.g. "0.97x"; "not measured" when a side is missing
    goal: str
    met: bool | None  # None: not measured
    note: str = ""


def _ratio(num: Throughput | None, den: Throughput | None) -> float | None:
    if num is None or den is None or den.tokens_per_s <= 0:
        return None
    return num.tokens_per_s / den.tokens_per_s


def paired_ratios(num: Throughput, den: Throughput) -> list[float]:
    """Round by round, num's run over den's run of the same round (measure.py runs a round's
    pair back to back); empty unless both ran the same rounds."""
    a, b = num.run_tokens_per_s, den.run_tokens_per_s
    if len(a) != len(b) or not all(x > 0 for x in b):
        return []
    return [x / y for x, y in zip(a, b)]


def _ratio_check(
    name: str,
    num: Throughput | None,
    den: Throughput | None,
    goal: float,
    missing: str,
    paired: bool = False,
) -> Check:
    """`paired`: with three rounds or more, the median of the rounds' ratios is the measure (the
    host's speed phases move whole runs by 20-30%: pairs cancel them, and a median ignores the
    pair a phase change split); the pooled ratio of all runs' tokens over time is in the note."""
    r = _ratio(num, den)
    if num is None or den is None or r is None:
        return Check(name, "not measured", f">= {goal:g}x", None, missing)
    bad = num.errors + den.errors
    if bad:
        return Check(name, f"{r:.2f}x", f">= {goal:g}x", False, f"{bad} failed requests")
    rounds = paired_ratios(num, den) if paired else []
    if len(rounds) < 3:
        return Check(name, f"{r:.2f}x", f">= {goal:g}x", r >= goal)
    med = statistics.median(rounds)
    note = (
        f"median of {len(rounds)} rounds' ratios ({min(rounds):.2f}-{max(rounds):.2f}); "
        f"pooled {r:.2f}x"
    )
    return Check(name, f"{med:.2f}x", f">= {goal:g}x", med >= goal, note)


def _pick(concurrencies: list[int], wanted: tuple[int, ...]) -> list[int]:
    """The wanted concurrencies that were run, else the largest one that was (smoke runs)."""
    hits = [c for c in wanted if c in concurrencies]
    return hits or concurrencies[-1:]


def throughput_checks(res: Results, p: Preset) -> list[Check]:
    out = []
    cs = [c.concurrency for c in p.cells]
    for c in cs:
        on, off = res.throughput("omlx", "top20", c), res.throughput("omlx", "off", c)
        name = f"ours top20 / ours off, c={c}"
        out.append(_ratio_check(name, on, off, TOP20_GOAL, "run omlx", paired=True))
    for c in _pick(cs, (32, 64)):
        ours, peer = res.throughput("omlx", "top5", c), res.throughput("mlx-lm", "top5", c)
        name = f"ours top5 / mlx-lm server top5, c={c}"
        out.append(_ratio_check(name, ours, peer, p.peer_goal, "run omlx and mlx-lm"))
    for c in p.json_cells:
        on, off = res.throughput("omlx", "json", c), res.throughput("omlx", "off", c)
        name = f"ours JSON schema / ours off, c={c}"
        out.append(_ratio_check(name, on, off, JSON_GOAL, "run omlx", paired=True))
    for c in _pick(cs, (64,)):
        ours, bare = res.throughput("omlx", "off", c), res.throughput("batchgen", "off", c)
        name = f"ours off / bare BatchGenerator, c={c}"
        out.append(_ratio_check(name, ours, bare, BATCHGEN_GOAL, "run omlx and batchgen"))
    return out


def scoring_check(res: Results) -> Check:
    """Scoring against our own plain prefill of prompts of the same length, through the same
    server and HTTP path: what scoring costs. Bare BatchGenerator's prefill is in the note."""
    name, goal = "prompt scoring / plain prefill (prompt tok/s)", f">= {SCORING_GOAL:g}x"
    score, plain = res.scoring("score"), res.scoring("prefill")
    if score is None or plain is None or score.tokens_per_s is None or not plain.tokens_per_s:
        note = score.note if score is not None and score.note else "run omlx"
        return Check(name, "not measured", goal, None, note)
    r = score.tokens_per_s / plain.tokens_per_s
    bare = res.scoring("bare")
    note = f"ours {score.tokens_per_s:.0f} against our plain prefill {plain.tokens_per_s:.0f}"
    if bare is not None and bare.tokens_per_s:
        note += f"; {score.tokens_per_s / bare.tokens_per_s:.2f}x bare BatchGenerator's prefill"
    if score.errors:
        return Check(name, f"{r:.2f}x", goal, False, f"{score.errors} failed: {score.note}")
    return Check(name, f"{r:.2f}x", goal, r >= SCORING_GOAL, note)


def ttft_check(res: Results) -> Check:
    name, goal = "TTFT, ours minus mlx-lm generate, c=1", f"<= {TTFT_GOAL_MS:g} ms"
    ours, gen = res.ttft("omlx"), res.ttft("generate")
    if ours is None or gen is None:
        return Check(name, "not measured", goal, None, "run omlx and batchgen")
    d = (ours.median_s - gen.median_s) * 1000
    value = f"{d:+.1f} ms ({ours.median_s * 1000:.1f} vs {gen.median_s * 1000:.1f})"
    if ours.errors:
        return Check(name, value, goal, False, f"{ours.errors} failed requests")
    return Check(name, value, goal, d <= TTFT_GOAL_MS)


def memory_check(res: Results) -> Check:
    name, goal = "RSS growth past warm-up, top_logprobs 20", f"< {MEMORY_GOAL:.0%}"
    mem = res.memory()
    if mem is None or mem.growth is None:
        return Check(name, "not measured", goal, None, "run memory")
    done = mem.points[-1].requests_done
    value = f"{mem.growth:+.1%} after {done} requests"
    if mem.errors:
        return Check(name, value, goal, False, f"{mem.errors} failed requests")
    return Check(name, value, goal, mem.growth < MEMORY_GOAL)


def quantized_check(res: Results, p: Preset) -> Check:
    """On the CPU `--dtype auto` dequantizes at load, so the 4-bit model serves as float32
    does; kept quantized it would be about ten times slower."""
    c = p.quantized.concurrency if p.quantized else 8
    q, f = res.throughput("4bit", "off", c), res.throughput("float32", "off", c)
    name = f"4-bit model (--dtype auto) / the same model in float32, c={c}"
    return _ratio_check(name, q, f, QUANTIZED_GOAL, "run quantized", paired=True)


def evaluate(res: Results, p: Preset) -> list[Check]:
    checks = [scoring_check(res), ttft_check(res), memory_check(res), quantized_check(res, p)]
    return throughput_checks(res, p) + checks
