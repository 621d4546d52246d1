"""The runner's start-up decisions, made once from the model, its caches and the device (each
probe checked against the model's own forward, each decision logged as it is made), and held in
one frozen record the runner and its parts read: the body/head split, the prefix cache's mode,
how resumed rows prefill, the decode step, the host path's alignments, whether speculation can
run."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx_logprobs.runner.batch_cache import kinds
from omlx_logprobs.runner.fast import compiled, lean_decode
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.fast.lean_decode import LeanDecode
from omlx_logprobs.runner.head import SplitForward
from omlx_logprobs.runner.prefix_cache import MIN_TOKENS, break_even, default_budget_mib
from omlx_logprobs.runner.probe import probe, resumes_in_a_batch
from omlx_logprobs.runner.snapshot import keeps_prefixes, keeps_sequences, keeps_states

__all__ = ["Plan", "make_plan"]

log = logging.getLogger("omlx_logprobs")

# On a GPU, MLX keeps every freed buffer for reuse up to about the device's memory: with batch
# and prompt sizes changing every step that grew to ~100 GB on an H200, and host RSS with it.
GPU_CACHE_LIMIT_MIB = 4096
# A left-padded prefill group's width is rounded up to this many tokens on a GPU: MLX's CUDA
# backend keeps host state per kernel shape (CUDA graphs, cuDNN attention plans, in bounded
# caches), which grew RSS with every new (rows, width) pair. On the CPU padding is real compute.
GPU_PREFILL_ALIGN = 32
CPU_PREFILL_ALIGN = 1
# Tests set this to run the GPU's path (extraction on the device, one packed read a step, the
# step processed beside the next launch) on the CPU backend.
FORCE_GPU_PATH = False
# The decode forward compiled (runner/fast/compiled.py), on a GPU only, and only when asked
# (OMLX_COMPILE_DECODE=1): on an H100 it cut the graph's Python (1.49 -> 0.96 ms a step at 64
# rows) but not the launch (5.07 -> 5.61 ms), and a server at c=64 ran slower with it; the lean
# step traced the same way was slower than the lean step as it is (docs/benchmarks.md,
# "Decisions").
COMPILE_DECODE = os.environ.get("OMLX_COMPILE_DECODE") == "1"

Decode = compiled.CompiledDecode | LeanDecode


@dataclass(frozen=True)
class Plan:
    """What `make_plan` decided for one runner, read by it and by its parts; never changed."""

    # The host path: MLX's CPU backend (not FORCE_GPU_PATH). Entries are then computed in numpy
    # at collect time, on the device elsewhere (logprobs/extractor.py).
    cpu: bool
    # Body and head apart (runner/head.py), where the model has them: the head then runs on
    # the positions needed only. Else every forward computes every position's logits.
    split: SplitForward | None
    # The prefix cache's budget (0: off, asked so or this model's caches cannot be kept), and
    # the fewest tokens a kept start must hold to pay here (prefix_cache.break_even).
    prefix_mib: int
    min_use: int
    # Finished sequences kept whole with their recurrent states (runner/snapshot.py).
    whole: bool
    # Rows resumed from states prefill in one right-padded forward (else one at a time).
    resumes_batched: bool
    # Finished sequences kept: plain KV layers, or whole with their states.
    keeps_finished: bool
    # On a GPU the host bounds the step loop: the engine processes a step beside the next
    # launch. MLX's CPU backend computes the step inside the launch on both cores: no gain.
    overlaps: bool
    prefill_align: int  # a left-padded prefill group's width is a multiple of it
    tight_cache: bool  # caches grow by what their rows may use (see batch_cache.py)
    # A decode step other than the model's forward, where one serves the model.
    decode: Decode | None
    # Where the decode batch is compiled, its shared left padding is trimmed in whole
    # multiples of the width it keeps (else every trim would widen the cache again).
    trim_align: int
    why_no_speculation: str | None  # None: speculative decoding can run here
    cache_limit_mib: int | None  # MLX's buffer cache bound (None: MLX's own)

    @property
    def split_head(self) -> bool:
        return self.split is not None


def make_plan(
    model: Any,
    templates: list[Any],
    fusion: Fusion,
    prefix_mib: int | None,
    compiles: bool,
    cache_limit_mib: int | None,
) -> Plan:
    """The decisions for `model` with its caches' `templates` (the model's own, one per layer);
    `compiles`: whether its runner may compile or replace its decode forward (a split model's
    may not). Raises UnbatchableCache for a model whose caches cannot be batched."""
    split = probe(model, templates)  # the body/head split, if any (head.py)
    mib, whole, min_use = _prefix_cache(model, templates, prefix_mib)
    resumes_batched = _resumes_batched(model, templates, whole)
    if split is None:
        log.info(
            "no body/head split found for %s: prefill computes logits at every position, "
            "and scored prompts prefill one at a time",
            type(model).__module__,
        )
    cpu = mx.default_device() == mx.cpu and not FORCE_GPU_PATH
    decode = _decode_step(model, templates, fusion, cpu) if compiles else None
    if cache_limit_mib is None and not cpu:
        cache_limit_mib = GPU_CACHE_LIMIT_MIB
    return Plan(
        cpu=cpu,
        split=split,
        prefix_mib=mib,
        min_use=min_use,
        whole=whole,
        resumes_batched=resumes_batched,
        keeps_finished=keeps_sequences(templates) or whole,
        overlaps=not cpu,
        prefill_align=CPU_PREFILL_ALIGN if cpu else GPU_PREFILL_ALIGN,
        tight_cache=cpu,
        decode=decode,
        trim_align=compiled.WIDTH_ALIGN if isinstance(decode, compiled.CompiledDecode) else 1,
        why_no_speculation=_why_no_speculation(templates, compiles),
        cache_limit_mib=cache_limit_mib,
    )


def _prefix_cache(model: Any, templates: list[Any], mib: int | None) -> tuple[int, bool, int]:
    """(budget, whole, min_use) of the prefix cache. Plain KV and sliding-window caches: any
    start of a kept sequence; plain KV and recurrent states: whole kept sequences
    (runner/snapshot.py). `mib` None: a share of the memory left after the weights."""
    if mib is None:
        mib = default_budget_mib()
        log.info("prefix cache: %d MiB (a quarter of the memory left after the weights)", mib)
    whole = keeps_states(templates)
    if mib > 0 and (keeps_prefixes(templates) or whole):
        if whole:
            log.info(
                "prefix cache: sequences kept whole with their recurrent states (%s); a "
                "prompt resumes from one it starts with",
                ", ".join(kinds(templates)),
            )
        min_use = break_even(model)
        if min_use > MIN_TOKENS:
            log.info(
                "prefix cache: kept starts of %d tokens or more (a forward's fixed cost here "
                "is that many tokens' compute; shorter ones are computed)",
                min_use,
            )
        return mib, whole, min_use
    if mib > 0:
        log.info(
            "prefix cache off for this model: its caches (%s) are neither keys and values "
            "nor recurrent states beside them; every prompt prefills in full",
            ", ".join(kinds(templates)),
        )
    return 0, False, MIN_TOKENS


def _resumes_batched(model: Any, templates: list[Any], whole: bool) -> bool:
    """Rows resumed from states prefill in one right-padded forward where the family's
    recurrent layers take each row's length (probe.py), else one at a time."""
    if not whole:
        return False
    together = resumes_in_a_batch(model, templates, model)
    how = "together, right-padded" if together else "one at a time"
    log.info("prefix cache: prompts resumed from kept states prefill %s", how)
    return together


def _decode_step(model: Any, templates: list[Any], fusion: Fusion, cpu: bool) -> Decode | None:
    """The decode forward compiled (runner/fast/compiled.py) where asked on a GPU, else the lean
    step (runner/fast/lean_decode.py) where it serves the model; each checked against the
    model's own forward at start-up. None: the model's forward (a split model's runner
    always takes it)."""
    why = lean_decode.eligible(model, fusion, templates)
    lean = LeanDecode(model, fusion, full_width=not cpu) if why is None else None
    if COMPILE_DECODE and not cpu:
        why_not = compiled.check(model, templates, lean)
        if why_not is None:
            log.info("decode steps compiled (runner/fast/compiled.py), lean: %s", lean is not None)
            return compiled.CompiledDecode(model, lean)
        log.info("decode steps not compiled for %s: %s", type(model).__module__, why_not)
    if lean is not None:
        why = lean_decode.check(lean, templates)
    if why is None:
        log.info("decode steps: the lean step (runner/fast/lean_decode.py)")
        return lean
    log.info("decode steps through the model's own forward: %s", why)
    return None


def _why_no_speculation(templates: list[Any], compiles: bool) -> str | None:
    """Why this model cannot speculate (None: it can): rejected positions leave a plain KV
    cache by trimming; a sliding window or a recurrent state cannot give them back. A split
    model's runner does not speculate."""
    found = kinds(templates)
    if found != ["KVCache"]:
        return f"its caches ({', '.join(found)}) cannot drop rejected positions"
    if not compiles:
        return "its runner is split over processes"
    return None
