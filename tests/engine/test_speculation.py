"""Speculative decoding (runner/speculation.py): every emitted token and every logprob field is
the one the same request gets without speculation, on several families, greedy and seeded;
cuts (stops, grammars, max_tokens) inside an accepted draft; and unseeded samples follow the
target's distribution whatever the draft (a chi-square test on a scripted model)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.scripted import ALT_STRIDE
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.drafts import NgramIndex, RowDrafts
from omlx_logprobs.runner.speculation import Speculator
from omlx_logprobs.types import (
    FinishReason,
    LogprobsMode,
    RequestOutput,
    SamplingParams,
)
from tests.engine.test_families import built
from tests.engine.test_structured import PET
from tests.helpers.engine import Record, count_verifies, encode, run_engine, run_on
from tests.helpers.scripted import write_description

OFF = EngineConfig(speculate="off")
PREDICT = EngineConfig(speculate="prediction", speculate_max_batch=8)
LOOKUP = EngineConfig(speculate="lookup", speculate_max_batch=8)
FIELDS = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens emitted by speculative steps, counted as they are collected."""
    return count_verifies(monkeypatch)


def same(a: Record, b: Record) -> None:
    """Two runs of one request: the same tokens, finish and entries (float rounding apart:
    a verify forward computes a position among others, a plain step alone)."""
    assert list(a.output_ids) == list(b.output_ids)
    assert a.finish_reason is b.finish_reason and a.error is None and b.error is None
    if a.store is None:
        assert b.store is None
        return
    assert b.store is not None
    for f in FIELDS:
        x, y = getattr(a.store.entries, f), getattr(b.store.entries, f)
        assert x.shape == y.shape, f
        if f in ("logprobs", "top_logprobs"):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
        elif f == "ranks":
            # A sampled token deep in the tail sits among near-equal logprobs: float rounding
            # moves its rank by the few within ~1e-5 of it (never near the top).
            bad = np.flatnonzero(x != y)
            assert (np.abs(x - y)[bad] <= 3).all() and (x[bad] > 20).all(), (x[bad], y[bad])
        else:
            assert np.array_equal(x, y), f


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def predicted(rec: Record, edit_at: int = 10) -> tuple[int, ...]:
    """The plain run's output with a few tokens replaced in the middle: an edited file."""
    out = list(rec.output_ids)
    return tuple(out[:edit_at] + [11, 12, 13] + out[edit_at + 2 :])


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_greedy_tokens_and_entries_equal_the_plain_run(
    name: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, verified: list[int]
) -> None:
    model = built(name, tmp_path_factory, tokenizer_dir)
    prompts = [
        encode(model, "def add(a, b):\n    return a + b\n" * 3),
        encode(model, "The quick brown fox jumps over the lazy dog."),
        encode(model, "one two three"),
    ]
    sp = SamplingParams(max_tokens=40, temperature=0, logprobs=True, top_logprobs=5)
    plain = run_engine(model, [(p, sp) for p in prompts], OFF)
    asks = [(p, replace(sp, prediction=predicted(r))) for p, (r, _) in zip(prompts, plain)]
    fast = run_engine(model, asks, PREDICT)
    for (a, _), (b, outs) in zip(plain, fast):
        same(a, b)
        assert outs[-1].accepted_prediction_tokens >= 20  # the unedited parts
        assert outs[-1].rejected_prediction_tokens > 0  # the edit
    assert sum(verified) > 3 * 20 and len(verified) < 3 * 20
    # Each row alone: the cache's rollback is a trim; together, rows also shift.
    ((b, _),) = run_engine(model, asks[:1], PREDICT)
    same(plain[0][0], b)
    verified.clear()
    for (a, _), (b, _) in zip(plain, run_engine(model, [(p, sp) for p in prompts], LOOKUP)):
        same(a, b)
    if name == "llama":  # this random model loops from the third token: lookup drafts
        assert sum(verified) > 2 * len(verified) > 0


def test_seeded_sampling_with_processors_equals_the_plain_run(
    tiny: LoadedModel, verified: list[int]
) -> None:
    """Temperature, top-k/top-p/min-p, penalties, logit bias, bad words, min_tokens, fixed ids,
    processed logprobs and n choices: each drafted position is processed as a plain step."""
    p = encode(tiny, "Once upon a time, there was a little robot named")
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4, logprobs_mode=LogprobsMode.PROCESSED),
        SamplingParams(
            temperature=0.7,
            seed=5,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            logit_bias=((13, 3.0), (17, -2.0)),
        ),  # fmt: skip
        SamplingParams(
            temperature=0, max_tokens=32, min_tokens=30, bad_words_ids=((13,), (198, 198))
        ),  # fmt: skip
        SamplingParams(
            temperature=0.9,
            seed=6,
            logprob_token_ids=(13, 17, 198),
            logprobs_mode=LogprobsMode.PROCESSED_LOGITS,
        ),  # fmt: skip
    ]
    reqs = [
        (p, replace(k, max_tokens=32, logprobs=True, top_logprobs=0 if k.logprob_token_ids else 4))
        for k in kinds
    ]
    plain = run_engine(tiny, reqs, OFF)
    asks = [(q, replace(sp, prediction=predicted(r, 6))) for (q, sp), (r, _) in zip(reqs, plain)]
    for (a, _), (b, _) in zip(plain, run_engine(tiny, asks, PREDICT)):
        same(a, b)
    assert sum(verified) > 2 * len(verified)


def test_a_grammar_and_its_end_inside_an_accepted_draft(
    tiny: LoadedModel, verified: list[int]
) -> None:
    p = encode(tiny, "Describe a pet as JSON:")
    sp = SamplingParams(max_tokens=160, temperature=1.0, seed=2, constraint=PET, logprobs=True,
                        top_logprobs=5, logprobs_mode=LogprobsMode.PROCESSED)  # fmt: skip
    plain = run_engine(tiny, [(p, replace(sp, seed=s)) for s in range(3)], OFF)
    assert any(r.finish_reason is FinishReason.STOP for r, _ in plain)
    asks = [(p, replace(sp, seed=s, prediction=predicted(r, 4))) for s, (r, _) in enumerate(plain)]
    for (a, ao), (b, bo) in zip(plain, run_engine(tiny, asks, PREDICT)):
        same(a, b)
        assert text(ao) == text(bo)
    assert sum(verified) > 2 * len(verified)


def test_stops_and_max_tokens_cut_inside_an_accepted_draft(
    tiny: LoadedModel, verified: list[int]
) -> None:
    p = encode(tiny, "A list of colours: red, green,")
    sp = SamplingParams(max_tokens=48, temperature=0, logprobs=True, top_logprobs=3)
    ((full, outs),) = run_engine(tiny, [(p, sp)], OFF)
    out, whole = list(full.output_ids), text(outs)
    cut_text = whole[len(whole) // 2 : len(whole) // 2 + 3]
    token = out[21]
    kinds = [
        replace(sp, max_tokens=19),
        replace(sp, stop=(cut_text,)),
        replace(sp, stop=(cut_text,), include_stop_str_in_output=True),
        replace(sp, stop_token_ids=(token,)),
    ]
    plain = run_engine(tiny, [(p, k) for k in kinds], OFF)
    fast = run_engine(tiny, [(p, replace(k, prediction=tuple(out))) for k in kinds], PREDICT)
    for (a, ao), (b, bo) in zip(plain, fast):
        same(a, b)
        assert text(ao) == text(bo)
        assert b.num_output < len(out)
        # The prediction is the output itself: every output token but the steps' own samples
        # was an accepted draft, and drafts past the cut are counted in neither
        accepted = bo[-1].accepted_prediction_tokens
        assert accepted < b.num_output and (b.num_output < 8 or accepted > b.num_output // 2)
        assert bo[-1].rejected_prediction_tokens == 0
    assert max(verified) > 4  # several tokens a step, cut where the plain run stopped


def test_rollback_shifts_each_row_by_what_it_rejected() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    layer = BatchKVCache([1, 0])
    k = mx.arange(2 * 6, dtype=mx.float32).reshape(2, 1, 6, 1)
    layer.update_and_fetch(k, k)
    cache = BatchCache([layer], [1, 0])
    cache.rollback([1, 3])  # row 0 keeps 6 - 1 columns, row 1 keeps 6 - 3
    keys, _ = layer.keys_and_values()
    assert layer._idx == 5 and cache.pads == [1, 2]
    assert layer.left_padding.tolist() == [1, 2] and layer.offset.tolist() == [4, 3]
    assert keys[0, 0, 1:, 0].tolist() == [1, 2, 3, 4]
    assert keys[1, 0, 2:, 0].tolist() == [6, 7, 8]


def test_drafts_follow_the_prediction_past_an_edit_and_the_row_s_own_text() -> None:
    idx = NgramIndex([1, 2, 3, 4, 1, 2, 5])
    assert idx.follow([9, 1, 2], 1, 0) == 2  # the first [1, 2] at or after 0
    assert idx.follow([9, 1, 2], 1, 3) == 6  # the next one
    assert idx.follow([7, 8], 1, 0) == -1
    rows = RowDrafts([5, 6, 7], (10, 11, 12, 13, 14, 15), lookup=False)
    assert rows.draft([5, 6, 7], [10, 11], 3) == ([12, 13, 14], True)
    assert rows.draft([5, 6, 7], [10, 11, 99, 13], 2) == ([14, 15], True)  # past a replaced token
    own = RowDrafts([1, 2, 3, 4, 9, 1, 2], (), lookup=True)
    assert own.draft([1, 2, 3, 4, 9, 1, 2], [3], 2) == ([4, 9], False)
    assert own.draft([1, 2, 3, 4, 9, 1, 2], [3, 8], 2) == ([], False)
    loop = RowDrafts([5, 6], (), lookup=True)  # a loop of period 2 continues as a loop
    assert loop.draft([5, 6], [7, 8, 7, 8], 5) == ([7, 8, 7, 8, 7], False)


# ---- the target's distribution, whatever the draft -------------------------------------------

LOGITS = (1.0, 0.5, 0.0)  # the scripted token's logit, then two alternatives'; the rest -30


@pytest.fixture(scope="module")
def dice(tmp_path_factory: pytest.TempPathFactory, embedded_dir: Path) -> LoadedModel:
    path = tmp_path_factory.mktemp("dice") / "dice.json"
    desc = write_description(path, chosen_logit=LOGITS[0], other_logits=list(LOGITS[1:]),
                             rest_logit=-30.0, chosen_slope=0.0)  # fmt: skip
    return load_model(str(desc))


def _dice_prompt(model: LoadedModel) -> list[int]:
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Case: plain"}], add_generation_prompt=True, tokenize=False
    )
    return list(model.tokenizer.encode(rendered, add_special_tokens=False))


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    want = probs * counts.sum()
    return float(((counts - want) ** 2 / want).sum())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "draft"),
    [
        (1.0, 0, 1.0, "alternative"),
        (0.6, 0, 1.0, "scripted"),
        (1.0, 2, 1.0, "alternative"),
        (1.3, 0, 0.6, "alternative"),
        (1.0, 0, 1.0, "outside"),
    ],  # fmt: skip
)
def test_unseeded_samples_follow_the_target_distribution(
    dice: LoadedModel, temperature: float, top_k: int, top_p: float, draft: str, verified: list[int]
) -> None:
    """At each step the model's three tokens have known probabilities. Drafts: always the first
    alternative (accepted a third of the time), the scripted token, or a token outside all
    three (never accepted); the emitted tokens' frequencies at steps 1..3 must fit the target's
    processed distribution (chi-square, 2 degrees of freedom, p = 0.001: 13.8)."""
    v = len(dice.vocab)
    prompt = _dice_prompt(dice)
    ((ref, _),) = run_engine(dice, [(prompt, SamplingParams(max_tokens=8, temperature=0))], OFF)
    script = list(ref.output_ids)
    alt = [(c + 1) % v for c in script]
    # Drafts follow a match of the output's last token in the prediction: "outside" matches
    # after a first scripted token, then proposes tokens the model never samples.
    outside = script[:1] + [(c + 5) % v for c in script[1:]]
    guess = {"alternative": alt, "scripted": script, "outside": outside}
    n, steps = 600, 4
    sp = SamplingParams(max_tokens=steps, temperature=temperature, top_k=top_k, top_p=top_p,
                        prediction=tuple(guess[draft]))  # fmt: skip
    cfg = EngineConfig(speculate="prediction", speculate_max_batch=64, num_draft_tokens=3)
    results = run_engine(dice, [(prompt, sp)] * n, cfg)
    logits = np.array(LOGITS) / temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if top_k:
        probs[top_k:] = 0
    if top_p < 1:
        keep = np.concatenate([[0.0], np.cumsum(probs)[:-1]]) < top_p
        probs[~keep] = 0
    probs /= probs.sum()
    assert sum(verified) > len(verified)  # drafts went through verify steps
    for t in range(1, steps):
        c = script[t]
        ids = [c, (c + 1) % v, (c + 1 + ALT_STRIDE) % v]
        got = np.array([sum(list(r.output_ids)[t] == i for r, _ in results) for i in ids])
        assert got.sum() == n  # the rest of the vocabulary never came up
        live = probs > 0
        assert (got[~live] == 0).all()
        if live.sum() > 1:
            assert _chi_square(got[live], probs[live]) < 13.8, (t, got, probs)


# ---- a draft model ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["itself", "qwen3"])
def test_a_draft_model_s_drafts_change_nothing(
    draft: str,
    tiny: LoadedModel,
    tiny_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
    verified: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The served model as its own draft (every greedy draft accepted: the mechanism's ceiling)
    and another family's random model (drafts mostly rejected): the same tokens and entries.
    A row with a penalty and a bad word reads its drafts on the host to process them; the
    others' reach the verify still on the device, in the same batch."""
    path = tiny_dir if draft == "itself" else built_dir("qwen3", tmp_path_factory, tokenizer_dir)
    cfg = EngineConfig(speculate="draft", draft_model=str(path), num_draft_tokens=5)
    prompts = [encode(tiny, "Once upon a time"), encode(tiny, "import numpy as np\n")]
    sp = SamplingParams(max_tokens=30, temperature=0, logprobs=True, top_logprobs=5)
    seeded = replace(sp, temperature=0.8, seed=11)
    read = replace(
        sp, frequency_penalty=0.5, bad_words_ids=((13,), (198, 198)),
        logprobs_mode=LogprobsMode.PROCESSED,
    )  # fmt: skip
    reqs = [(p, sp) for p in prompts] + [(prompts[0], seeded), (prompts[1], read)]
    plain = run_engine(tiny, reqs, OFF)
    if draft == "itself":  # all K proposed: its cost (a step as dear as the target's) says one
        monkeypatch.setattr(Speculator, "_length", lambda self, row: self.k)
    on_host: set[tuple[str, bool]] = set()  # (request, whether its drafts were read at launch)
    launch = Speculator.launch

    def launching(self: Speculator, batch: Any, target: Any) -> Any:
        step = launch(self, batch, target)
        if step is not None and step.spec is not None:
            on_host.update(
                (s.request_id, isinstance(d, list))
                for s, d in zip(step.seqs, step.spec.drafts)
                if len(d)  # a row with no draft this step (none fits before max_tokens) pads
            )
        return step

    monkeypatch.setattr(Speculator, "launch", launching)
    for (a, _), (b, _) in zip(plain, run_engine(tiny, reqs, cfg)):
        same(a, b)
    assert on_host == {("r0", False), ("r1", False), ("r2", False), ("r3", True)}
    if draft == "itself":  # greedy rows: all accepted, 6 tokens a verify step
        assert max(verified) >= 12
        assert sum(verified) > 3 * len(verified)
    else:
        assert verified


def test_a_draft_row_s_cache_capacity_is_never_a_multiple_of_256(tiny: LoadedModel) -> None:
    """MLX's CUDA backend builds a cuDNN graph for a one-position attention over each new
    cache capacity that is a multiple of 256 (seconds each): a draft row's capacity never is,
    from a first feed of exactly 256 ids on, through drafts taken, rejected and fed again."""
    from omlx_logprobs.runner.draft_model import DraftModel

    draft = DraftModel(tiny.model, len(tiny.vocab))
    rng = np.random.default_rng(0)
    context = [int(t) for t in rng.integers(0, 1000, 256)]
    capacities = set()
    while len(context) < 900:
        drafts = draft.propose(7, context, int(rng.integers(1, 9))).tolist()
        taken = int(rng.integers(0, len(drafts) + 1))
        context += drafts[:taken] + [int(rng.integers(0, 1000))]
        for c in draft._rows[7].layers:
            mx.eval(c.keys)
            capacities.add(c.keys.shape[2])
            assert c.keys.shape[2] % 256 != 0
    assert len(capacities) >= 3  # it grew twice at least


def test_the_start_up_warm_meets_every_verify_width_and_leaves_nothing(
    tiny: LoadedModel, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the engine first runs an internal request through a verify of every draft width
    and feeds the draft model every first length (MLX's CUDA backend builds kernels for each
    shape it meets first): here forced on the CPU. The first client request then takes no
    warm's tokens, finds no kept sequence of it, and gets what an engine without the warm
    gives."""
    from omlx_logprobs.runner import speculation
    from omlx_logprobs.runner.draft_model import DraftModel
    from omlx_logprobs.runner.model_runner import ModelRunner

    cfg = EngineConfig(speculate="draft", draft_model=str(tiny_dir), num_draft_tokens=4)
    prompt = encode(tiny, "Once upon a time")
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    plain = run_engine(tiny, [(prompt, sp)], cfg)
    widths: list[tuple[str, int]] = []  # (the request, positions a row) of each forward
    forward_rows = ModelRunner.forward_rows

    def recording(self: ModelRunner, inputs: Any) -> Any:
        widths.append((self.batch.rows[0].request_id, inputs.shape[1]))
        return forward_rows(self, inputs)

    fed: list[int] = []  # ids each proposal fed the draft model first
    propose = DraftModel.propose

    def feeding(self: DraftModel, seq_id: int, context: list[int], k: int) -> list[int]:
        row = self._rows.get(seq_id)
        fed.append(len(context) - (min(row.sure, len(context) - 1) if row else 0))
        return propose(self, seq_id, context, k)

    kept: list[str] = []
    keep_finished = ModelRunner._keep_finished

    def keeping(self: ModelRunner, rows: list[int]) -> None:
        if self.keeps_finished:
            kept.extend(self.batch.rows[i].request_id for i in rows)
        keep_finished(self, rows)

    monkeypatch.setattr(ModelRunner, "forward_rows", recording)
    monkeypatch.setattr(DraftModel, "propose", feeding)
    monkeypatch.setattr(ModelRunner, "_keep_finished", keeping)
    monkeypatch.setattr(speculation, "WARM_ON_CPU", True)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, cfg, tokenizer=tiny.tokenizer)
    warmed = run_on(engine, [(prompt, sp)])
    warm = {n for r, n in widths if r == "warm-speculation"}
    assert set(range(2, 6)) <= warm  # verifies of 1 to 4 drafts: 2 to 5 positions
    assert set(range(1, 6)) <= set(fed[:10])  # first feeds of 1 to K + 1 ids, before any request
    assert kept == ["r0"]
    same(plain[0][0], warmed[0][0])


def test_the_warm_without_a_draft_model_runs_on_the_gpu_path(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up warm of a server with neither a draft model nor `--speculate` (the
    prediction mode), on the GPU's path: its last verify is processed on the engine's thread
    like every speculative step. Processed on the second thread, its rollback's arrays were
    that thread's, and the next launch failed ("There is no Stream(gpu, 2) in current
    thread"): the warm was lost, and the first predictions paid the shapes."""
    from omlx_logprobs.runner import plan, speculation

    prompt = encode(tiny, "Once upon a time")
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=True, top_logprobs=5)
    plain = run_engine(tiny, [(prompt, sp)], OFF)
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    monkeypatch.setattr(speculation, "WARM_ON_CPU", True)
    caplog.set_level(logging.INFO, logger="omlx_logprobs")
    draft = Speculator._draft

    def rejected(self: Speculator, s: Any) -> tuple[Any, bool]:
        if self._forced:  # drafts the target never takes: every verify rolls back
            width = min(self._forced.pop(), s.params.max_tokens - s.num_sampled - 1)
            return [len(tiny.vocab) - 1] * width, False
        return draft(self, s)

    monkeypatch.setattr(Speculator, "_draft", rejected)
    cfg = EngineConfig(speculate="prediction", num_draft_tokens=4)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, cfg, tokenizer=tiny.tokenizer)
    served = run_on(engine, [(prompt, sp)])
    assert "verify shapes warmed" in caplog.text and "the warm failed" not in caplog.text
    same(plain[0][0], served[0][0])


def test_an_engine_starts_once_its_warm_is_done(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`Engine.start` returns after the start-up warm (a server then says it is ready), so a
    first request does not wait behind it; a fault in the warm is logged and the engine
    serves."""
    done: list[str] = []
    started: list[list[str]] = []  # what was done when `start` returned

    def warm(self: Engine) -> None:
        time.sleep(0.3)
        done.append("warmed")
        raise RuntimeError("a fault after the warm")

    start = Engine.start

    def starting(self: Engine) -> None:
        start(self)
        started.append(list(done))

    monkeypatch.setattr(Engine, "_warm_speculation", warm)
    monkeypatch.setattr(Engine, "start", starting)
    prompt, sp, served, _ = _serve_one(tiny)
    assert started == [["warmed"]]
    assert "the start-up warm failed" in caplog.text
    same(run_engine(tiny, [(prompt, sp)], OFF)[0][0], served)


def test_a_fault_in_the_warm_leaves_the_engine_serving(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warm is a speed-up: a fault in it is logged and the engine serves as without it."""
    from omlx_logprobs.runner import speculation

    collect = Speculator.collect

    def failing(self: Speculator, batch: Any, step: Any, spec: Any) -> Any:
        if step.seqs[0].request_id == "warm-speculation":
            raise RuntimeError("a fault in the warm")
        return collect(self, batch, step, spec)

    monkeypatch.setattr(Speculator, "collect", failing)
    monkeypatch.setattr(speculation, "WARM_ON_CPU", True)
    prompt, sp, served, engine = _serve_one(tiny)
    assert "the warm failed" in caplog.text
    assert engine.runner.speculator is not None and not engine.runner.speculator._forced
    monkeypatch.setattr(speculation, "WARM_ON_CPU", False)
    same(run_engine(tiny, [(prompt, sp)], LOOKUP)[0][0], served)


def _serve_one(tiny: LoadedModel) -> tuple[list[int], SamplingParams, Record, Engine]:
    """One greedy request served by a new engine with prompt lookup: the prompt, its
    parameters, what it got, and the engine."""
    prompt = encode(tiny, "Once upon a time")
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, LOOKUP, tokenizer=tiny.tokenizer)
    return prompt, sp, run_on(engine, [(prompt, sp)])[0][0], engine


def built_dir(name: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from tests.helpers.families import build_family

    out = tmp_path_factory.getbasetemp() / f"draft-{name}"
    if not (out / "model.safetensors").exists():
        build_family(name, out, tokenizer_dir, seed=99)
    return out


def test_a_draft_model_of_another_tokenizer_is_refused_at_start_up(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from tests.helpers.server import server_process

    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(RuntimeError, match="--draft-model: token id .* a draft model must share"):
        with server_process(["--model", str(tiny_dir), "--draft-model", str(other)], start_s=60):
            pass


def test_the_gpu_path_speculates_the_same(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, verified: list[int]
) -> None:
    """On the GPU's path (entries extracted on the device, a step processed beside the next
    launch, full-width caches) a speculating batch is processed before each launch; rows that
    leave mid-run and the overlap coming back once nothing speculates."""
    from omlx_logprobs.runner import plan

    prompts = [encode(tiny, "Once upon a time"), encode(tiny, "A list of colours: red,")]
    sp = SamplingParams(max_tokens=40, temperature=0, logprobs=True, top_logprobs=5)
    plain = run_engine(tiny, [(p, sp) for p in prompts], OFF)
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    asks = [(prompts[0], replace(sp, prediction=predicted(plain[0][0], 8))),
            (prompts[1], replace(sp, max_tokens=12))]  # fmt: skip
    fast = run_engine(tiny, asks, PREDICT)
    same(plain[0][0], fast[0][0])
    assert list(fast[1][0].output_ids) == list(plain[1][0].output_ids)[:12]
    assert sum(verified) > 2 * len(verified)


def test_a_prediction_that_never_matches_keeps_the_overlapped_plain_step(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, verified: list[int]
) -> None:
    """On the GPU's path a row whose prediction never matches its text costs nothing: no step
    in flight is processed before the next launch for it, no verify runs, and its tokens and
    entries are the plain run's (a wrong prediction made requests 7-11% slower on a GPU)."""
    from omlx_logprobs.runner import plan

    prompt = encode(tiny, "Once upon a time")
    sp = SamplingParams(max_tokens=40, temperature=0, logprobs=True, top_logprobs=5)
    plain = run_engine(tiny, [(prompt, sp)], OFF)
    seen = set(plain[0][0].output_ids.tolist()) | set(prompt)
    wrong = tuple(t for t in range(len(tiny.vocab)) if t not in seen)[:64]
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", True)
    synced: list[bool] = []
    needs = Engine._needs_history

    def recorded(self: Engine) -> bool:
        synced.append(needs(self))
        return synced[-1]

    monkeypatch.setattr(Engine, "_needs_history", recorded)
    fast = run_engine(tiny, [(prompt, replace(sp, prediction=wrong))], PREDICT)
    same(plain[0][0], fast[0][0])
    assert verified == [] and len(synced) > 30 and not any(synced)


def test_a_row_is_promising_only_where_its_last_tokens_match() -> None:
    """A prediction's row syncs where its output's last token continues in the prediction;
    a lookup row where its last two tokens occurred before."""
    row = RowDrafts([9, 9], [1, 2, 3, 4, 5], lookup=False)
    assert not row.promising([9, 9], [7, 8])
    assert row.promising([9, 9], [7, 2]) and not row.promising([9, 9], [5])  # 5: nothing after
    own = RowDrafts([10, 11, 12, 13], (), lookup=True)
    assert not own.promising([10, 11, 12, 13], [14, 11])
    assert own.promising([10, 11, 12, 13], [14, 10, 11])


def test_reasoning_sections_and_entries_with_a_prediction(
    scripted: LoadedModel, verified: list[int]
) -> None:
    """The scripted thinker's cases, each predicted exactly: whole scripts accepted a step at a
    time, the same reasoning and content split, the same entries (closed form)."""
    from omlx_logprobs.parsing.thinking import think_start
    from tests.engine.test_scripted import check_sections, prompt
    from tests.helpers.scripted import CASES, case_ids

    names = list(CASES)
    prompts = [prompt(scripted, n, i % 3) for i, n in enumerate(names)]
    thinks = [think_start(True, scripted.tokenizer.decode(p[-4:])) for p in prompts]
    sp = SamplingParams(max_tokens=64, temperature=0, logprobs=True, top_logprobs=20)
    asks = [(p, replace(sp, prediction=tuple(case_ids(scripted, n)[0]))) for p, n in
            zip(prompts, names)]  # fmt: skip
    plain = run_engine(scripted, [(p, sp) for p in prompts], OFF, thinks)
    fast = run_engine(scripted, asks, PREDICT, thinks)
    for name, (a, _), (b, outs) in zip(names, plain, fast):
        same(a, b)
        check_sections(outs, name, case_ids(scripted, name)[1])
    assert max(verified) > 8


class _Draft:
    """The draft model's place in the off rule's test: the rule reads only what it proposed."""

    def forget(self, live: set[int]) -> None:
        pass


def test_the_off_rule_prices_a_draft_model_s_steps() -> None:
    """A draft model's drafts each cost one of its steps: all rejected, the row rests at once
    and tries one draft next (then rests twice as long); all accepted, it proposes as many as
    pay (6 of 8 where its step costs half a plain one), and rests where its steps cost more
    than they save. A
    prediction's drafts cost only the verify's positions."""
    from types import SimpleNamespace

    from omlx_logprobs.runner import speculation

    spec = Speculator("draft", 8, 4, draft=_Draft())  # type: ignore[arg-type]
    spec.break_even, spec.draft_cost = 3.4, 0.5  # the H200's verify, a 1.1B draft of an 8B
    seq: Any = SimpleNamespace(seq_id=1)

    def row(modeled: bool = True) -> Any:
        r = speculation._Row(RowDrafts((1, 2, 3), None, False), float(spec.k + 1))
        r.modeled = modeled
        spec._rows[1] = r
        return r

    r = row()
    spec._score(seq, 1, 8)  # 8 drafts, none taken: 7.4 plain steps for one token
    assert (spec._length(r), r.pause) == (1, 4)
    pauses = []
    for _ in range(3):
        r.pause = 0
        spec._score(seq, 1, spec._length(r))  # one draft, rejected: 1.8 steps for one token
        pauses.append(r.pause)
    assert pauses == [8, 16, 32] and spec._length(r) == 1
    r = row()
    for _ in range(20):
        spec._score(seq, 9, 8)  # every draft taken: 9 tokens for 7.4 steps
    assert (spec._length(r), r.pause) == (6, 0)
    spec.draft_cost = 1.0  # the target as its own draft: 11.4 steps for 9 tokens
    spec._score(seq, 9, 8)
    assert r.pause == 4
    r = row(modeled=False)
    for _ in range(20):
        spec._score(seq, 3, 2)  # a prediction's two drafts taken: 3 tokens for 1.6 steps
    assert r.pause == 0


def test_a_draft_model_proposes_what_pays_at_its_rate() -> None:
    """The proposal length maximizes the expected tokens per plain step of cost at the row's
    running rate of taken drafts: the longer, the cheaper the verify and the draft model's
    steps and the likelier each draft is taken."""
    from types import SimpleNamespace

    from omlx_logprobs.runner import speculation

    spec = Speculator("draft", 8, 4, draft=_Draft())  # type: ignore[arg-type]
    r = speculation._Row(RowDrafts((1, 2, 3), None, False), 9.0)
    lengths = {}
    for rate in (0.3, 0.6, 0.75, 0.9):
        r.taken, r.tried = rate, 1.0
        # a bfloat16 8B on an H100 with its one-layer draft; a 4-bit one with a 1B draft
        spec.break_even, spec.draft_cost = 1.3, 0.06
        cheap = spec._length(r)
        spec.break_even, spec.draft_cost = 3.4, 0.15
        lengths[rate] = (cheap, spec._length(r))
    assert lengths == {0.3: (1, 1), 0.6: (3, 1), 0.75: (5, 2), 0.9: (8, 3)}
    spec._rows[1] = r
    r.modeled, r.taken, r.tried = True, 0.75, 1.0
    spec._score(SimpleNamespace(seq_id=1), 4, 8)  # 3 of 8 taken, the 4th rejected
    assert (r.taken, r.tried) == pytest.approx((0.8 * 0.75 + 0.2 * 3, 0.8 + 0.2 * 4))


def test_the_verify_s_cost_is_measured_on_the_served_model(
    monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel, tiny_dir: Path
) -> None:
    """What a verify of K drafts costs depends on the backend and the weights' format (MLX's
    CUDA backend on sm90: a tiled matmul from two rows for 4 bits, one read of the weights for
    bfloat16; Metal's one-row kernel up to 12-33 rows): the speculator times it at start-up,
    K + 1 positions against one, and a draft model's step against the served model's."""
    from omlx_logprobs.runner import draft_model, speculation

    def timed(model: Any, reps: int = 5, width: int = 1) -> float:
        seconds = {1: 0.010, 9: 0.024}[width]
        return seconds if model is tiny.model else seconds / 4  # the draft: a quarter

    monkeypatch.setattr(speculation, "step_seconds", timed)
    import mlx.core as mx

    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # timed on a GPU only
    plan: Any = type("Plan", (), {"why_no_speculation": None})()  # a plain KV model's
    cfg = EngineConfig(speculate="draft", draft_model=str(tiny_dir), num_draft_tokens=8)
    spec = speculation.speculator(cfg, plan, tiny.model, tiny.vocab)
    assert spec is not None
    assert spec.break_even == pytest.approx(2.4) and spec.draft_cost == pytest.approx(0.25)
    # Timed for real, each call's tokens are trimmed off again: every timed forward of the 9
    # positions starts from the same 32-token cache.
    offsets: list[int] = []

    class Recording:
        layers = tiny.model.layers

        def __call__(self, ids: Any, cache: Any) -> Any:
            offsets.append(cache[0].offset)
            return tiny.model(ids, cache=cache)

    assert draft_model.step_seconds(Recording(), reps=3, width=9) > 0
    assert offsets == [0] + [32] * 5
