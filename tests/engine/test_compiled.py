"""The compiled decode forward (runner/fast/compiled.py, the GPU's path) against a full forward
pass: rows joining and leaving the batch, the cache growing past its first width, new weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import plan
from omlx_logprobs.runner.fast import compiled, lean_decode
from omlx_logprobs.types import SamplingParams
from tests.helpers.engine import check_against_reference, encode, moved_copy, run_engine

PROMPTS = ["Hello, how are you today?", "The quick brown fox", "1 2 3 4 5", "Once upon a time"]


@pytest.fixture(params=["lean", "model"])
def calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The GPU's path on the CPU backend, the traced step runner/fast/lean_decode.py's or the
    model's forward; each compiled decode call's batch size, recorded."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    monkeypatch.setattr(lean_decode, "ENABLED", request.param == "lean")
    monkeypatch.setattr(plan, "COMPILE_DECODE", True)  # opt-in (OMLX_COMPILE_DECODE=1)
    seen: list[int] = []
    traced: set[str] = set()
    call = compiled.CompiledDecode.__call__

    def counted(self: compiled.CompiledDecode, inputs, cache):  # type: ignore[no-untyped-def]
        traced.add("lean" if self.lean is not None else "model")
        seen.append(len(cache))
        return call(self, inputs, cache)

    monkeypatch.setattr(compiled.CompiledDecode, "__call__", counted)
    yield seen
    assert request.param in traced  # the engine traced the step it was meant to


def test_compiled_decode_equals_a_full_forward(tiny: LoadedModel, calls: list[int]) -> None:
    """Six requests through three rows (they join as others leave, at other widths), one long
    enough to write past the cache's first 256 columns: every entry equals a full forward's
    float32 log-softmax, and the tokens equal the uncompiled path's."""
    lengths = [300, 5, 9, 3, 12, 7]
    requests = [
        (
            encode(tiny, PROMPTS[i % 4]),
            SamplingParams(
                max_tokens=n, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5
            ),
        )
        for i, n in enumerate(lengths)
    ]
    cfg = EngineConfig(max_num_seqs=3)
    done = run_engine(tiny, requests, cfg)
    assert len(calls) >= 299 and set(calls) >= {1, 2, 3}  # every decode step, every batch size
    for (prompt, _), (seq, _) in zip(requests, done):
        check_against_reference(tiny, prompt, seq, 5)
    plan.COMPILE_DECODE = False
    try:
        plain = run_engine(tiny, requests, cfg)
    finally:
        plan.COMPILE_DECODE = True
    for (a, _), (b, _) in zip(done, plain):
        assert list(a.output_ids) == list(b.output_ids)
        np.testing.assert_allclose(a.store.logprobs, b.store.logprobs, atol=1e-5)


def test_compiled_decode_follows_new_weights(
    tiny_dir: Path, tmp_path: Path, calls: list[int]
) -> None:
    """The weights are constants of the compiled traces: after an update the decode computes
    with the new ones (each entry against a full forward of the moved model)."""
    model = load_model(str(tiny_dir))  # its own copy: the update writes into it
    moved = moved_copy(tiny_dir, tmp_path)
    engine = Engine(model.model, model.vocab, model.eos_token_ids, EngineConfig())
    prompt = encode(model, PROMPTS[1])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)

    def generate() -> Sequence:
        seq = Sequence("r", list(prompt), params)
        engine.scheduler.add(seq)
        while engine.has_work():
            engine.step()
        return seq

    before = generate()
    check_against_reference(model, prompt, before, 0)
    engine.runner.load_weights(str(moved))
    after = generate()
    assert calls
    check_against_reference(load_model(str(moved)), prompt, after, 0)
    assert not np.allclose(before.store.logprobs, after.store.logprobs, atol=1e-3)


def test_a_model_whose_step_cannot_compile_is_served_uncompiled(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, calls: list[int]
) -> None:
    """The start-up check catches a compiled step that fails (a backend without one of its
    ops): the runner keeps the uncompiled forward, and the entries stay right."""

    def missing(self: object, keys: object, values: object) -> None:
        raise RuntimeError("no kernel for this op")

    monkeypatch.setattr(compiled._Slot, "update_and_fetch", missing)
    assert "no kernel for this op" in (
        compiled.check(tiny.model, make_prompt_cache(tiny.model)) or ""
    )
    prompt = encode(tiny, PROMPTS[0])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    [(seq, _)] = run_engine(tiny, [(prompt, params)])
    assert calls == [2, 2]  # the two start-up checks (here, then the engine's); none after
    check_against_reference(tiny, prompt, seq, 0)
