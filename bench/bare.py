"""The `batchgen` part of a benchmark run: bare mlx-lm, in-process, no HTTP, same model and
same prompts as the server parts. Run by run.py as a subprocess, so the runner itself never
holds the accelerator:

    python -m bench.bare --preset gpu --model-dir DIR --out part.json

- throughput: mlx-lm `BatchGenerator` at each concurrency of the preset (completion batch size =
  concurrency, chat-templated prompts, no stop tokens), in the same runs as our server gets
  (rounds x requests per run);
- plain prefill: the scoring prompts through `BatchGenerator` with one new token;
- TTFT: mlx-lm `stream_generate` on the TTFT prompts, time to the first non-empty text.
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from bench.engine_bench import run_batchgen
from bench.loadgen import make_prompt, percentile
from omlx_logprobs.models.loader import LoadedModel, load_model
from bench.presets import PRESETS, TTFT_SEED, CellSpec, Preset
from bench.results import PartResult, Results, Scoring, Throughput, Ttft

BARE_SEED = 1000  # throughput prompts; the server parts use seeds 1, 2, ...


def chat_ids(m: LoadedModel, text: str) -> list[int]:
    """The prompt ids our server makes of a one-message chat (omlx_logprobs/api/core/prompts.py)."""
    messages = [{"role": "user", "content": text}]
    rendered = m.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(m.tokenizer.encode(rendered, add_special_tokens=False))


def throughput(m: LoadedModel, p: Preset, spec: CellSpec) -> Throughput:
    """As our server is measured: `rounds` runs of `requests_per_run` each, tokens over the sum
    of their wall times. Each run has its ramp and its tail, where the batch is not full; one
    run of all the requests would have one tail for all of them."""
    n, per_run = spec.requests_per_run * spec.rounds, spec.requests_per_run
    seed = BARE_SEED + spec.concurrency
    prompts = [chat_ids(m, make_prompt(i, p.prompt_words, seed)) for i in range(n)]
    tokens, seconds = 0, 0.0
    for r in range(spec.rounds):
        t0 = time.perf_counter()
        batch = prompts[r * per_run : (r + 1) * per_run]
        tokens += run_batchgen(m, batch, p.max_tokens, batch_size=spec.concurrency)
        seconds += time.perf_counter() - t0
    errors = 0 if tokens == n * p.max_tokens else n
    return Throughput(
        "batchgen", "off", spec.concurrency, n, spec.rounds, tokens / seconds, None, errors
    )


def prefill(m: LoadedModel, p: Preset) -> Scoring:
    """The scoring prompts, tokenized as /v1/completions does (no chat template), one token."""
    s = p.score
    prompts = [m.tokenizer.encode(make_prompt(i, s.prompt_words, 0)) for i in range(s.requests)]
    t0 = time.perf_counter()
    run_batchgen(m, prompts, 1, batch_size=s.concurrency)
    seconds = time.perf_counter() - t0
    total = sum(len(x) for x in prompts)
    return Scoring("bare", s.concurrency, s.requests, total, total / seconds)


def first_text(m: LoadedModel, tok: TokenizerWrapper, ids: list[int]) -> tuple[float, float]:
    """(seconds to the first token, seconds to the first non-empty text) of stream_generate."""
    t0 = time.perf_counter()
    first: float | None = None
    for r in stream_generate(m.model, tok, ids, max_tokens=64):
        first = first or time.perf_counter() - t0
        if r.text or r.finish_reason:
            break
    return first or 0.0, time.perf_counter() - t0


def ttft(m: LoadedModel, p: Preset) -> Ttft:
    """mlx-lm generate as its users run it: the TokenizerWrapper of mlx-lm's own loader, made
    once (wrapping a bare tokenizer on every call rebuilds the detokenizer's map: ~150 ms)."""
    tok = load_tokenizer(m.path)
    prompts = [
        chat_ids(m, make_prompt(i, p.prompt_words, TTFT_SEED)) for i in range(p.ttft_requests)
    ]
    first_text(m, tok, prompts[0])  # warm-up
    times = [first_text(m, tok, ids) for ids in prompts]
    firsts, texts = [t[0] for t in times], [t[1] for t in times]
    return Ttft(
        "generate",
        len(prompts),
        round(statistics.mean(len(x) for x in prompts)),
        statistics.median(texts),
        percentile(texts, 0.9),
        first_token_median_s=statistics.median(firsts),
    )


def run(p: Preset, model_dir: Path) -> PartResult:
    t0 = time.perf_counter()
    m = load_model(str(model_dir))
    log(f"bare mlx-lm on {mx.default_device()}, model {m.path}")
    for c in sorted({c.concurrency for c in p.cells}):  # compile kernels, allocate: not timed
        warm = [chat_ids(m, make_prompt(i, p.prompt_words, 0)) for i in range(c)]
        run_batchgen(m, warm, p.warmup_tokens)
    part = PartResult("batchgen", "", 0.0, "")
    for spec in p.cells:
        part.throughput.append(throughput(m, p, spec.capped(p.peer_rounds)))
        t = part.throughput[-1]
        log(f"  batchgen c={t.concurrency:<3} {t.tokens_per_s:8.1f} tok/s ({t.requests} requests)")
    part.scoring.append(prefill(m, p))
    log(f"  plain prefill {part.scoring[-1].tokens_per_s:8.1f} prompt tok/s")
    part.ttft.append(ttft(m, p))
    log(f"  generate TTFT median {part.ttft[-1].median_s * 1000:.1f} ms")
    part.seconds = time.perf_counter() - t0
    part.finished = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return part


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    part = run(PRESETS[a.preset], a.model_dir)
    Results(a.preset, str(a.model_dir), parts=[part]).save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
