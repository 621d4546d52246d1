"""Every mlx-lm family the server batches, whatever cache mlx-lm builds for it (plain KV, sliding
windows, SSM and linear-attention state, hybrids, mixtures of experts): a tiny seeded random
model of each, served by the engine, against an independent computation (the model's own
forward on the whole sequence with a fresh cache, float32 log-softmax)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.commands import Abort, Submit
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import plan, probe
from omlx_logprobs.runner.batch_cache import UnbatchableCache
from omlx_logprobs.types import EngineRequest, FinishReason, SamplingParams
from tests.helpers.engine import (
    StoreView,
    check_against_reference,
    check_prompt_store,
    reference_logprobs,
)
from tests.helpers.families import FAMILIES, WINDOW, build_family

# Families whose every layer is a plain KV or sliding-window cache: the ones that take any start
# of a kept sequence (the others hold a recurrent state, kept at a sequence's end).
KEEPS_PREFIXES = {
    *("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gpt2", "gemma2"),
    *("gemma3_text", "gpt_oss", "ministral3"),
}
CHUNK = 16  # prefill chunk: the longest prompts take two or three steps

_built: dict[str, LoadedModel] = {}


def built(name: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LoadedModel:
    """The family's tiny model, built once a session."""
    if name not in _built:
        path = build_family(name, tmp_path_factory.mktemp(name), tokenizer_dir)
        _built[name] = load_model(str(path))
    return _built[name]


@pytest.fixture(params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[str, LoadedModel]:
    return request.param, built(request.param, tmp_path_factory, tokenizer_dir)


def prompt(i: int, n: int) -> list[int]:
    """n token ids of their own (a seeded draw), longer than every sliding window here."""
    rng = np.random.default_rng(100 + i)
    return [int(x) for x in rng.integers(10, 49000, size=n)]


GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=True, ignore_eos=True)


@dataclass
class Req:
    rid: str
    ids: list[int]
    params: SamplingParams
    n: int = 1
    at: int = 0  # the step it arrives at
    abort_at: int | None = None  # the step it is aborted at


# A mixed batch: greedy and sampled, top 20, prompt logprobs, n choices; a long prompt that
# prefills in chunks; two late arrivals that join a batch whose windows have already slid; an
# abort in the middle.
MIXED = [
    Req("scored", prompt(0, 21), replace(GREEDY, top_logprobs=20, prompt_logprobs=20)),
    Req("sampled", prompt(1, 13), replace(GREEDY, temperature=1.0, seed=3, top_logprobs=20)),
    Req("forks", prompt(2, 38), replace(GREEDY, temperature=0.8, seed=5, top_logprobs=5), n=2),
    Req("aborted", prompt(3, 11), replace(GREEDY, max_tokens=30, top_logprobs=2), abort_at=5),
    Req("late", prompt(4, 25), replace(GREEDY, max_tokens=6, top_logprobs=20), at=4),
    Req("late-sampled", prompt(5, 12), replace(GREEDY, temperature=0.7, seed=9), at=6),
]


def serve(
    model: LoadedModel, reqs: list[Req], cfg: EngineConfig | None = None
) -> tuple[Engine, dict[str, list[Sequence]]]:
    """Step a fresh engine (no thread) through requests arriving and aborted at given steps;
    each request's choices, the engine's own records."""
    engine = Engine(
        model.model, model.vocab, model.eos_token_ids, cfg or EngineConfig(prefill_chunk=CHUNK)
    )
    out: dict[str, list[Sequence]] = {}
    for step in range(200):
        for r in reqs:
            if r.at == step:
                engine.post(Submit(EngineRequest(r.rid, list(r.ids), r.params, n=r.n, stream=True)))
            if r.abort_at == step:
                engine.post(Abort(r.rid))
        engine._drain_inbox()
        for rid, members in engine._live.items():
            out.setdefault(rid, members)
        if step > max(r.at for r in reqs) and not engine.has_work():
            break
        engine.step()
        engine.flush()
    assert not engine.has_work()
    return engine, out


def view(store: Any) -> StoreView:
    return StoreView(store.block(0, len(store)))


def check_choice(model: LoadedModel, seq: Sequence) -> None:
    """Every entry of a choice (sampled ones, top lists, ranks) against the full forward."""
    check_against_reference(model, seq.prompt_ids, seq, seq.params.num_top, tie=1e-5)


def check_prompt(model: LoadedModel, seq: Sequence) -> None:
    rec = SimpleNamespace(prompt_store=view(seq.prompt_store), prompt_ids=seq.prompt_ids)
    ref = reference_logprobs(model, seq.prompt_ids)
    check_prompt_store(rec, ref, seq.params.num_prompt_top)  # type: ignore[arg-type]


def test_a_mixed_batch_matches_a_full_forward(family: tuple[str, LoadedModel]) -> None:
    name, model = family
    assert all(len(r.ids) > WINDOW for r in MIXED)
    _, got = serve(model, MIXED)
    for r in MIXED:
        choices = got[r.rid]
        assert len(choices) == r.n
        for seq in choices:
            if r.abort_at is None:
                assert seq.finish_reason is FinishReason.LENGTH
                assert seq.num_output == r.params.max_tokens
            else:  # what it had generated before the abort is still right
                assert seq.finish_reason is FinishReason.ABORT
            check_choice(model, seq)
        if r.params.prompt_logprobs is not None:
            check_prompt(model, choices[0])
    forks = got["forks"]
    assert list(forks[0].output_ids) != list(forks[1].output_ids)  # each samples its own


def test_a_request_alone_equals_it_inside_a_batch(family: tuple[str, LoadedModel]) -> None:
    name, model = family
    _, batch = serve(model, MIXED)
    for r in (MIXED[1], MIXED[2], MIXED[4]):
        _, alone = serve(model, [replace(r, at=0)])
        for a, b in zip(alone[r.rid], batch[r.rid], strict=True):
            assert list(a.output_ids) == list(b.output_ids)
            np.testing.assert_allclose(view(a.store).logprobs, view(b.store).logprobs, atol=1e-4)


def test_a_prefix_cache_hit_equals_a_miss(
    family: tuple[str, LoadedModel], caplog: pytest.LogCaptureFixture
) -> None:
    """Prompts sharing a 24-token start (three windows), two of them 40 tokens: every family
    starts the later ones from a kept prefix (the 40-token one made from the 24-token one),
    with the same numbers as without; those with recurrent states from starts kept whole."""
    name, model = family
    system, more = prompt(10, 24), prompt(11, 16)
    starts = [system, system, system + more, system + more]
    reqs = [
        Req(f"p{i}", s + prompt(20 + i, 2 + 3 * i), replace(GREEDY, top_logprobs=3), at=i)
        for i, s in enumerate(starts)
    ]
    with caplog.at_level(logging.INFO, logger="omlx_logprobs"):
        engine, on = serve(model, reqs, EngineConfig(prefill_chunk=64))
    _, off = serve(model, reqs, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    cached = [on[r.rid][0].cached_tokens for r in reqs]
    if name in KEEPS_PREFIXES:
        assert engine.runner.prefixes is not None
        if mx.default_device() == mx.cpu:
            assert cached == [0, 24, 24, 40]
        else:  # a GPU processes steps beside the launch: prefixes are kept a step later
            assert cached[0] == 0 and sum(cached) > 0
    else:  # recurrent states: the made starts, kept whole, and taken whole
        assert engine.runner.prefixes is not None and engine.runner.prefixes.whole
        assert "kept whole with their recurrent states" in caplog.text
        if mx.default_device() == mx.cpu:
            assert cached == [0, 24, 24, 40]
    for r in reqs:
        a, b = on[r.rid][0], off[r.rid][0]
        check_choice(model, a)
        assert list(a.output_ids) == list(b.output_ids)
        np.testing.assert_allclose(view(a.store).logprobs, view(b.store).logprobs, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next"])
def test_without_a_body_head_split_the_generic_forward_serves(
    name: str,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose head is not found apart from its body: every forward computes every
    position's logits, scored prompts prefill one at a time, and the numbers are the same."""
    monkeypatch.setattr(probe, "split_forward", lambda *args: None)
    model = built(name, tmp_path_factory, tokenizer_dir)
    engine, got = serve(model, MIXED[:3])
    assert not engine.runner.plan.split_head
    for r in MIXED[:3]:
        for seq in got[r.rid]:
            check_choice(model, seq)
    check_prompt(model, got["scored"][0])


@pytest.mark.parametrize(
    "name", ["gemma2", "gemma3_text", "gpt_oss", "mamba2", "qwen3_next", "falcon_h1"]
)
def test_the_gpu_path_with_padding_wider_than_the_windows(
    name: str,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU's step path on the CPU backend: group widths rounded up to 32 (left padding of up
    to 31 columns, past every window and before every state), mlx-lm's cache growth, entries
    extracted on the device, steps processed beside the next launch; prefixes seeded under that
    padding where the family keeps them."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    model = built(name, tmp_path_factory, tokenizer_dir)
    engine, got = serve(model, MIXED)
    assert engine.runner.plan.prefill_align == 32 and not engine.runner.plan.tight_cache
    for r in MIXED:
        for seq in got[r.rid]:
            check_choice(model, seq)
    check_prompt(model, got["scored"][0])
    system = prompt(10, 24)
    reqs = [
        Req(f"p{i}", system + prompt(20 + i, 2 + 13 * i), replace(GREEDY, top_logprobs=3), at=i)
        for i in range(3)
    ]
    engine, on = serve(model, reqs, EngineConfig(prefill_chunk=64))
    for r in reqs:
        check_choice(model, on[r.rid][0])
    # Rows whose padding is shorter than the prefix start from it (a suffix of 15 tokens
    # rounded up to 32 columns: 17 of padding, 7 tokens of the prefix taken).
    if name in KEEPS_PREFIXES:
        assert max(on[r.rid][0].cached_tokens for r in reqs) > 0


def test_a_family_that_cannot_run_a_batch_is_refused_at_start_up(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """mlx-lm's gemma2 module as it is, without models/padded_batch.py's fix: its grouped
    queries' scores broadcast the padding mask over the wrong axes, and the probe refuses it."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = build_family("gemma2", tmp_path / "gemma2", tokenizer_dir)
    model = load_model(str(path), weights=False)
    net, _ = mlx_lm_load_model(path)
    net.set_dtype(mx.float32)
    with pytest.raises(UnbatchableCache, match="the gemma2 model cannot run a left-padded batch"):
        Engine(net, model.vocab, model.eos_token_ids, EngineConfig())
