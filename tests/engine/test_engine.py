"""The engine against an independent computation: every returned logprob, rank and top list
equals a full forward pass with a float32 log-softmax, alone and inside a batch."""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import (
    AdapterChange,
    Control,
    ControlResult,
    PauseMode,
    WeightUpdate,
    WeightUpdateResult,
)
from omlx_logprobs.engine.commands import (
    Abort,
    ChangeAdapter,
    ControlCommand,
    Stop,
    Submit,
    UpdateWeights,
)
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import plan
from omlx_logprobs.types import EngineRequest, FinishReason, LogprobsMode, SamplingParams
from tests.helpers.engine import (
    check_against_reference,
    client_of,
    collect_outputs,
    encode,
    reference_logprobs,
    run_engine,
    run_on,
)
from tests.helpers.faults import FailingModel, PoisonModel

PROMPTS = [
    "Hello, how are you today?",
    "The quick brown fox",
    "1 2 3 4 5",
    "Écrire en français, 日本語 and emoji 😀",
]


@pytest.mark.parametrize("k", [0, 5, 20])
def test_greedy_logprobs_match_full_forward(tiny: LoadedModel, k: int) -> None:
    prompt = encode(tiny, PROMPTS[0])
    params = SamplingParams(
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=k, ignore_eos=True
    )
    [(seq, outs)] = run_engine(tiny, [(prompt, params)])
    check_against_reference(tiny, prompt, seq, k)
    assert all(r == 1 for r in seq.store.ranks)  # greedy: the sampled token is the argmax
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_sampled_logprobs_are_raw_distribution(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[1])
    params = SamplingParams(
        max_tokens=16,
        temperature=1.3,
        top_p=0.9,
        seed=7,
        logprobs=True,
        top_logprobs=4,
        ignore_eos=True,
    )
    [(seq, _)] = run_engine(tiny, [(prompt, params)])
    check_against_reference(tiny, prompt, seq, 4)
    assert max(seq.store.ranks) > 1  # sampling did leave the argmax somewhere


def test_batch_of_16_equals_each_alone(tiny: LoadedModel) -> None:
    prompts = [encode(tiny, f"{PROMPTS[i % 4]} #{i}" * (1 + i % 3)) for i in range(16)]
    params = [
        SamplingParams(
            max_tokens=6 + i % 5, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
        )
        for i in range(16)
    ]
    together = run_engine(tiny, list(zip(prompts, params)), EngineConfig(prefill_chunk=7))
    for i, (seq, _) in enumerate(together):
        [(alone, _)] = run_engine(tiny, [(prompts[i], params[i])])
        assert list(seq.output_ids) == list(alone.output_ids)
        np.testing.assert_allclose(seq.store.logprobs, alone.store.logprobs, atol=1e-4)
        np.testing.assert_allclose(seq.store.top_logprobs, alone.store.top_logprobs, atol=1e-4)
        check_against_reference(tiny, prompts[i], seq, 3)


@pytest.mark.parametrize("align", [1, 32])
def test_prompts_prefilled_together_with_left_padding_equal_each_alone(
    tiny: LoadedModel, align: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`align` 32: the GPU's group widths rounded up (more left padding), run here on the CPU."""
    monkeypatch.setattr(plan, "CPU_PREFILL_ALIGN", align)
    # Lengths 1 to ~60 in one budget: several left-padded groups in one step; the max_tokens=1
    # requests finish at their first token, so their rows are filtered out of their group.
    prompts = [encode(tiny, "word " * (1 + (i * 7) % 30))[: 1 + (i * 13) % 60] for i in range(12)]
    params = [
        SamplingParams(
            max_tokens=1 if i % 4 == 1 else 5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            ignore_eos=True,
        )
        for i in range(12)
    ]
    together = run_engine(tiny, list(zip(prompts, params)))
    for i, (seq, _) in enumerate(together):
        assert seq.num_output == params[i].max_tokens
        check_against_reference(tiny, prompts[i], seq, 2)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a GPU keeps mlx-lm's cache growth")
def test_cpu_kv_cache_grows_by_what_its_rows_may_write(tiny: LoadedModel) -> None:
    """A prefill allocates its prompt and its max_tokens (not mlx-lm's 256 columns); rows that
    join a running batch, right-aligned with less room left than they may write, make it grow
    by what they need. Every row still matches the full forward pass."""
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig())
    runner = engine.runner
    assert runner.plan.tight_cache
    params = [
        SamplingParams(max_tokens=n, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
        for n in (40, 33, 21, 3)
    ]
    prompts = [encode(tiny, "word " * n) for n in (2, 12, 3, 1)]
    seqs = [Sequence(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    widths = []
    engine.scheduler.add(seqs[0])
    for step in range(80):
        if step == 33:  # the first row has written ~36 of its 64 columns
            for s in seqs[1:]:
                engine.scheduler.add(s)
        if not engine.has_work():
            break
        engine.step()
        if runner.batch.cache is not None:
            widths.append(runner.batch.cache.layers[0].keys.shape[2])
    assert all(s.num_output == sp.max_tokens for s, sp in zip(seqs, params))
    for s, p in zip(seqs, prompts):
        check_against_reference(tiny, p, s, 2)
    assert widths[0] == 16 + 48  # the first prompt (< 16 tokens) and its 40 tokens, aligned
    # The joiners are right-aligned at ~36 in 64 columns, so the 33-token row runs out: one
    # growth, by what the rows may still write then (aligned to 16), never by 256. (The first
    # row's end trims the shared left padding before that.)
    grown = [b - a for a, b in zip(widths, widths[1:]) if b > a]
    assert len(grown) == 1 and 16 <= grown[0] <= 48


def test_gpu_path_equals_host_path(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's step path (entries extracted by MLX, one packed int32 array read a step), run
    on the CPU backend, against the CPU's numpy path: same tokens, same entries, for a batch
    mixing every kind of logprobs request."""
    base = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    params = [
        replace(base, logprobs=True, top_logprobs=20),
        replace(base, temperature=0.9, seed=3, logprobs=True, top_logprobs=5),
        replace(
            base,
            temperature=0.7,
            top_p=0.8,
            seed=5,
            logprobs=True,
            top_logprobs=4,
            logprobs_mode=LogprobsMode.PROCESSED,
        ),
        replace(base, logprobs=True, top_logprobs=3, logprob_token_ids=(5, 9, 11)),
        replace(base, logit_bias=((7, 5.0),)),
        replace(base, logprobs=True),
    ]
    requests = [(encode(tiny, PROMPTS[i % 4]), p) for i, p in enumerate(params)]
    host = run_engine(tiny, requests)
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    device = run_engine(tiny, requests)
    for (a, _), (b, _), p in zip(host, device, params):
        assert list(a.output_ids) == list(b.output_ids)
        if not p.logprobs:
            continue
        np.testing.assert_allclose(b.store.logprobs, a.store.logprobs, atol=1e-5)
        assert list(b.store.ranks) == list(a.store.ranks)
        np.testing.assert_allclose(b.store.top_logprobs, a.store.top_logprobs, atol=1e-5)
        assert list(b.store.top_ids) == list(a.store.top_ids)
    # And against a full forward pass: the raw-distribution rows with natural top lists.
    for i, k in ((0, 20), (1, 5), (5, 0)):
        check_against_reference(tiny, requests[i][0], device[i][0], k)


def test_gpu_path_refuses_a_non_finite_row(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU's path the finiteness flag travels in the packed array: a row whose logits
    turn NaN ends its request with an error, and its batch neighbour runs to its end."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    poison = encode(tiny, "zebra")[-1]
    model = replace(tiny, model=PoisonModel(tiny.model, poison))
    base = SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    prompt = encode(tiny, PROMPTS[1])
    bad, good = run_engine(
        model, [(prompt, replace(base, logit_bias=((poison, 100.0),))), (prompt, base)]
    )
    assert bad[1][-1].finish_reason is FinishReason.ERROR
    assert "non-finite" in (bad[0].error or "") and list(bad[0].output_ids) == [poison]
    assert good[1][-1].finish_reason is FinishReason.LENGTH and good[0].num_output == 5
    check_against_reference(tiny, prompt, good[0], 2)


def test_gpu_path_launch_failure_ends_every_request(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch that raises while the step before it is processed on the second thread: every
    request ends with the engine's error, none hangs, and the entries it had are complete."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    model = replace(tiny, model=FailingModel(tiny.model, fail_at=4))
    params = SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    done = run_engine(model, [(encode(tiny, p), params) for p in PROMPTS])
    for seq, outs in done:
        assert outs[-1].finish_reason is FinishReason.ERROR
        assert "launch fault injected" in (seq.error or "")
        assert 0 < seq.num_output < 20 and seq.store is not None
        assert len(seq.store) == seq.num_output


def test_seeded_sampling_is_independent_of_batch(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[2])
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    [(alone, _)] = run_engine(tiny, [(prompt, params)])
    others = [(encode(tiny, p), SamplingParams(max_tokens=8, temperature=0.8)) for p in PROMPTS]
    mixed = run_engine(tiny, others[:2] + [(prompt, params)] + others[2:])
    assert list(mixed[2][0].output_ids) == list(alone.output_ids)


def test_stream_deltas_concatenate_to_text_and_entries(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[3])
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, logprobs=True, ignore_eos=True)
    [(seq, outs)] = run_engine(tiny, [(prompt, params)])
    # Each output carries its own tokens and their entries: together, every token once.
    assert sum(o.num_tokens for o in outs) == seq.num_output == 40
    assert all(o.logprobs is not None and len(o.logprobs) == o.num_tokens for o in outs)
    text = "".join(o.text for o in outs)
    data = b"".join(tiny.vocab.token_bytes[t] or b"" for t in seq.output_ids)
    assert text == data.decode("utf-8", errors="replace")


def test_stop_string_across_tokens_is_not_returned(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[0])
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    [(seq, outs)] = run_engine(tiny, [(prompt, free)])
    full = "".join(o.text for o in outs)
    stop = full[10:13]  # three characters in the middle, very likely across a token boundary
    [(seq2, outs2)] = run_engine(tiny, [(prompt, replace(free, stop=(stop,)))])
    text = "".join(o.text for o in outs2)
    assert text == full[: full.index(stop)]
    assert outs2[-1].finish_reason is FinishReason.STOP


def test_logit_bias_forces_a_token(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[1])
    target = encode(tiny, " banana")[0]
    params = SamplingParams(
        max_tokens=3, temperature=0, logit_bias=((target, 100.0),), logprobs=True, ignore_eos=True
    )
    processed = replace(params, logprobs_mode=LogprobsMode.PROCESSED)
    [(seq, _), (raw, _)] = run_engine(tiny, [(prompt, processed), (prompt, params)])
    assert list(seq.output_ids) == list(raw.output_ids) == [target] * 3
    assert all(lp > -1e-3 for lp in seq.store.logprobs)  # processed: after the bias
    # raw (vLLM's meaning): the model's own distribution, before the bias
    ref = reference_logprobs(tiny, prompt + [target] * 3)[len(prompt) - 1 : -1]
    for i in range(3):
        assert abs(raw.store.logprobs[i] - ref[i][target]) < 1e-4


def test_a_logit_bias_alone_needs_no_history(tiny: LoadedModel) -> None:
    """A bias is a fixed row: it is a logit processor but reads no earlier token, so a batch
    holding it keeps the step in flight beside the next launch; any penalty does read them."""
    bias = SamplingParams(logit_bias=((7, 1.0),))
    assert bias.processes and not bias.penalizes
    assert not SamplingParams().processes
    penalties = [
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=0.5, logit_bias=((7, 1.0),)),
    ]
    assert all(p.processes and p.penalizes for p in penalties)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig())
    engine.scheduler.running.append(Sequence("a", [1, 2], bias))
    assert not engine._needs_history()
    for i, p in enumerate(penalties):
        engine.scheduler.running[:] = [Sequence("a", [1, 2], bias), Sequence(f"p{i}", [1, 2], p)]
        assert engine._needs_history()


def test_eos_finishes_with_stop_and_keeps_its_entry(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[0])
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias=((2, 100.0),), logprobs=True)
    [(seq, outs)] = run_engine(tiny, [(prompt, params)])
    assert list(seq.output_ids) == [2]
    assert outs[-1].finish_reason is FinishReason.STOP and sum(o.num_tokens for o in outs) == 1
    assert "".join(o.text for o in outs) == ""


def test_penalties_match_an_independent_application(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[0])
    params = SamplingParams(
        max_tokens=8,
        temperature=0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=True,
        ignore_eos=True,
        logprobs_mode=LogprobsMode.PROCESSED,  # at temperature 0: after the penalties
    )
    [(seq, _)] = run_engine(tiny, [(prompt, params)])
    out = list(seq.output_ids)
    import mlx.core as mx

    logits = np.array(tiny.model(mx.array([prompt + out]))[0].astype(mx.float32))
    for i, tok in enumerate(out):
        row = logits[len(prompt) - 1 + i].astype(np.float64)
        seen = set(prompt) | set(out[:i])
        for t in seen:
            row[t] = row[t] / 1.3 if row[t] > 0 else row[t] * 1.3
        for t in set(out[:i]):
            row[t] -= 0.5 * out[:i].count(t) + 0.25
        lp = row - np.log(np.sum(np.exp(row - row.max()))) - row.max()
        assert tok == int(np.argmax(row))
        assert abs(seq.store.logprobs[i] - lp[tok]) < 1e-4


def test_top_k_one_samples_the_argmax(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[2])
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    topk1 = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=5, ignore_eos=True)
    minp = SamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, seed=5, ignore_eos=True)
    runs = run_engine(tiny, [(prompt, greedy), (prompt, topk1), (prompt, minp)])
    assert list(runs[0][0].output_ids) == list(runs[1][0].output_ids) == list(runs[2][0].output_ids)


def test_top_p_keeps_sampled_tokens_inside_the_nucleus(tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPTS[1])
    params = SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.5, seed=9, logprobs=True, ignore_eos=True
    )
    [(seq, _)] = run_engine(tiny, [(prompt, params)])
    out = list(seq.output_ids)
    ref = reference_logprobs(tiny, prompt + out)[len(prompt) - 1 : -1]
    for i, tok in enumerate(out):
        p = np.exp(ref[i].astype(np.float64))
        mass_before = p[p > p[tok]].sum()
        assert mass_before < 0.5 + 1e-5


def test_bfloat16_weights_are_served_from_the_engine_thread(tiny_dir: Path, tmp_path: Path) -> None:
    # On the CPU the loader casts to float32; a lazy cast made on the loading thread could not
    # be evaluated on the engine thread ("no Stream(cpu, 0) in current thread").
    out = tmp_path / "bf16"
    shutil.copytree(tiny_dir, out)
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(out / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    )
    model = load_model(str(out))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    [(seq, outs)] = run_engine(model, [([1, 2, 3], params)])
    assert outs[-1].finish_reason is FinishReason.LENGTH and seq.num_output == 3


def test_mlx_cache_is_limited_and_emptied_when_idle(tiny: LoadedModel) -> None:
    """A GPU's MLX buffer cache otherwise grows towards the device's size; the limit is set
    when asked, and whatever is cached goes back once the engine is idle."""
    before = mx.set_cache_limit(1 << 40)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig(cache_limit_mib=64))
    client = client_of(engine)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
        reqs = [EngineRequest(f"r{i}", [1, 2, 3 + i], params, stream=True) for i in range(4)]

        async def run() -> None:
            await asyncio.gather(*(collect_outputs(client, r) for r in reqs))

        asyncio.run(run())
        deadline = time.monotonic() + 10
        while engine.snapshot().cache_memory and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.snapshot().cache_memory == 0
        assert mx.set_cache_limit(1 << 40) == 64 << 20
    finally:
        client.shutdown()
        mx.set_cache_limit(before)
    with pytest.raises(ValueError, match="cache_limit_mib"):
        EngineConfig(cache_limit_mib=-1)


def test_aborts_read_together_release_their_rows_at_once(tiny: LoadedModel) -> None:
    """Clients that leave together: their aborts, read in one drain of the inbox, end every
    choice and free the rows in one release (one filter of the batch's caches; one by one they
    cost a 64-row CPU batch ~0.45 s each, and the rows of clients long gone ran on)."""
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig())
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(6):
        engine.post(Submit(EngineRequest(f"r{i}", encode(tiny, f"story {i}"), params, n=1 + i % 2)))
    engine._drain_inbox()
    for _ in range(3):
        engine.step()
    assert len(engine.runner.batch.rows) == 9
    released: list[int] = []
    release = engine.runner.release
    engine.runner.release = lambda seqs: released.append(len(seqs)) or release(seqs)  # type: ignore[method-assign]
    for i in range(5):
        engine.post(Abort(f"r{i}"))
    engine._drain_inbox()
    assert released == [7] and len(engine.runner.batch.rows) == 2
    assert [s.finish_reason for s in engine._live["r0"]] == [FinishReason.ABORT]
    assert engine.snapshot().aborted_running == 7


def test_posted_commands_are_answered_between_steps_or_refused_at_stop(
    tiny: LoadedModel,
) -> None:
    """`Engine.post`: a notice's future is done at once; an answered command's once the engine
    has read it between two steps (a wait pause once nothing runs); what is still unanswered
    when the engine stops is answered with why not."""
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig())
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    assert engine.post(Submit(EngineRequest("r", encode(tiny, "story"), params))).done()
    flush = engine.post(ControlCommand(Control("flush")))
    unload = engine.post(ChangeAdapter(AdapterChange("nobody")))
    assert not flush.done() and not unload.done()
    engine._drain_inbox()
    assert flush.result(0) == ControlResult(False)
    assert "nobody" in str(unload.result(0))  # an adapter never loaded: why nothing changed
    [seq] = engine._live["r"]
    engine.step()
    pause = engine.post(ControlCommand(Control("pause", PauseMode.WAIT)))
    engine._drain_inbox()
    engine.life.settle()
    assert not pause.done() and engine.snapshot().paused == "wait"  # "r" runs on
    update = engine.post(UpdateWeights(WeightUpdate("/nowhere")))  # never read
    engine.post(Stop())
    engine.start()  # the loop ends at once: what is left is refused
    engine.shutdown()
    why = "the server is shutting down"
    assert pause.result(0) == ControlResult(False, error=why)
    assert update.result(0) == WeightUpdateResult(engine.weights, why)
    assert seq.finish_reason is FinishReason.ERROR


def test_a_step_fault_that_also_fails_the_release_still_ends_every_request(
    tiny: LoadedModel,
) -> None:
    """The step failed and releasing its rows fails too (the same broken state): every request
    still ends with the error, the batch is emptied, and the engine serves the next request."""
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig())
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.post(Submit(EngineRequest(f"r{i}", encode(tiny, f"story {i}"), params)))
    engine._drain_inbox()
    for _ in range(3):
        engine.step()
    assert len(engine.runner.batch.rows) == 3
    release = engine.runner.release

    def broken(seqs: list[Sequence]) -> None:
        raise RuntimeError("the caches are in no state to filter")

    engine.runner.release = broken  # type: ignore[method-assign]
    engine._fail_all("internal error in the engine step: boom")
    assert engine.runner.batch.rows == [] and engine.runner.batch.cache is None
    for i in range(3):
        [seq] = engine._live[f"r{i}"]
        assert seq.finish_reason is FinishReason.ERROR
    engine.runner.release = release  # type: ignore[method-assign]
    [(seq, _)] = run_on(engine, [(encode(tiny, "hi"), params)])
    assert seq.num_output == 50 and seq.error is None
