"""Training on the served weights (training/trainer.py), against mlx-lm's own LoRA layers and
optimizer: one forward_backward + optim_step on the tiny model gives the gradients and updated
LoRA weights of the same step done with `LoRALinear` layers (scale alpha / rank) and mlx's
AdamW (bias correction, decoupled weight decay, clipping); gradients add up over calls; the
built-in losses' terms; a trained adapter published is served as runner/lora.py serves one
(the trainer's forward and the served adapter's agree); bad calls change
nothing; a checkpoint in mlx-lm's adapter format loads in mlx-lm and back with its optimizer
state; datums of several lengths in one padded forward give each datum's numbers alone, and the
sum of their gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import load_adapters

from omlx_logprobs.models.loader import load_model
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.lora import AdapterSet
from omlx_logprobs.training.calls import (
    AdamSpec,
    BatchPass,
    CreateRun,
    DatumPass,
    LoadRun,
    LoraSpec,
    OptimStep,
    Publish,
    SaveRun,
)
from omlx_logprobs.training.lora import ALPHA
from omlx_logprobs.training.trainer import Trainer

RANK = 4
TOKENS = np.array([5, 17, 300, 42, 9000, 77, 1200, 8, 3, 640], np.int32)


@pytest.fixture
def trainer(tiny_dir: Path) -> Trainer:
    model = load_model(str(tiny_dir)).model  # its own copy: the run adapts its layers
    vocab = model.args.vocab_size
    return Trainer(model, AdapterSet(model), make_prompt_cache(model), vocab)


def datum(loss: str = "cross_entropy", tokens: np.ndarray = TOKENS, **extra: Any) -> DatumPass:
    n = len(tokens) - 1
    rng = np.random.default_rng(3)
    inputs = {
        "target_tokens": tokens[1:].astype(np.int64),
        "weights": np.linspace(0.5, 1.5, n).astype(np.float32),
        "advantages": rng.normal(size=n).astype(np.float32),
        "logprobs": rng.uniform(-9, -8, n).astype(np.float32),
        "sequence_ratio_mask": (np.arange(n) >= 3).astype(np.float32),
    }
    return DatumPass("run", tokens[:-1], inputs, loss, **extra)


def answer(trainer: Trainer, call: Any) -> Any:
    got = trainer.handle(call)
    assert got.error is None, got.error
    return got.value


def reference_step(
    tiny_dir: Path, initial: dict[str, dict[str, mx.array]], adam: AdamSpec
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """mlx-lm's LoRALinear on the same layers from the same weights, its cross-entropy
    (weighted sum) gradient and one AdamW step: (gradients, updated weights) by name."""
    model = load_model(str(tiny_dir)).model
    model.freeze()
    modules = dict(model.named_modules())
    swaps = []
    for path, p in initial.items():
        lora = LoRALinear.from_base(modules[path], r=RANK, scale=ALPHA / RANK, dropout=0.0)
        lora.lora_a, lora.lora_b = p["lora_a"], p["lora_b"]
        swaps.append((path, lora))
    model.update_modules(tree_unflatten(swaps))
    d = datum()
    x = mx.array(d.tokens)[None]
    targets = mx.array(d.inputs["target_tokens"].astype(np.int32))
    weights = mx.array(d.inputs["weights"])

    def loss_fn(m: nn.Module) -> mx.array:
        logits = m(x)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -(weights * mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]).sum()

    _, grads = nn.value_and_grad(model, loss_fn)(model)
    opt = optim.AdamW(
        learning_rate=adam.learning_rate, betas=[adam.beta1, adam.beta2], eps=adam.eps,
        weight_decay=adam.weight_decay, bias_correction=True,
    )  # fmt: skip
    clipped, _ = optim.clip_grad_norm(grads, adam.grad_clip_norm or float("inf"))
    opt.update(model, clipped)
    mx.eval(model.parameters())
    g = {k: v for k, v in tree_flatten(grads) if "lora" in k}
    w = {k: v for k, v in tree_flatten(model.trainable_parameters())}
    return g, w


def flat(params: dict[str, dict[str, mx.array]]) -> dict[str, mx.array]:
    return {f"{path}.{k}": v for path, p in params.items() for k, v in p.items()}


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_step_equals_mlx_lm_lora_and_adamw(trainer: Trainer, tiny_dir: Path, clip: float) -> None:
    layers = answer(trainer, CreateRun("run", LoraSpec(RANK, seed=7, unembed=False)))
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of the two blocks
    run = trainer.run("run")
    # lora_b starts at zero (mlx-lm's init): give it values, so that lora_a's gradient is not 0
    key = mx.random.key(1)
    for p in run.params.values():
        key, sub = mx.random.split(key)
        p["lora_b"] = 0.05 * mx.random.normal(p["lora_b"].shape, key=sub)
    initial = {path: dict(p) for path, p in run.params.items()}
    adam = AdamSpec(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1,
                    grad_clip_norm=clip)  # fmt: skip
    answer(trainer, datum())
    grads = flat(run.grads or {})
    answer(trainer, OptimStep("run", adam))
    ref_g, ref_w = reference_step(tiny_dir, initial, adam)
    assert set(ref_g) == set(grads) and len(grads) == 28
    for name, g in grads.items():
        np.testing.assert_allclose(np.array(g), np.array(ref_g[name]), rtol=1e-4, atol=1e-6)
    for name, w in flat(run.params).items():
        np.testing.assert_allclose(np.array(w), np.array(ref_w[name]), rtol=1e-5, atol=1e-6)
    assert run.grads is None and run.steps == 1


def test_gradients_add_up_until_the_step(trainer: Trainer) -> None:
    answer(trainer, CreateRun("run", LoraSpec(RANK, seed=1, mlp=False)))
    run = trainer.run("run")
    answer(trainer, datum())
    once = flat(run.grads or {})
    answer(trainer, datum())
    for name, g in flat(run.grads or {}).items():
        np.testing.assert_allclose(np.array(g), 2 * np.array(once[name]), rtol=1e-6)
    forward = answer(trainer, datum(backward=False))  # a forward adds nothing
    for name, g in flat(run.grads or {}).items():
        np.testing.assert_allclose(np.array(g), 2 * np.array(once[name]), rtol=1e-6)
    assert forward.loss == pytest.approx(-(forward.logprobs * datum().inputs["weights"]).sum(),
                                         rel=1e-5)  # fmt: skip


def test_losses(trainer: Trainer) -> None:
    answer(trainer, CreateRun("run", LoraSpec(RANK, seed=2)))
    d = datum().inputs
    ce = answer(trainer, datum(backward=False))
    lp = ce.logprobs.astype(np.float64)
    np.testing.assert_allclose(ce.elementwise_loss, -d["weights"] * lp, rtol=1e-5)
    ratio = np.exp(lp - d["logprobs"])
    adv = d["advantages"]
    seq = np.exp((lp - d["logprobs"])[d["sequence_ratio_mask"] != 0].mean())  # GSPO's ratio
    expected = {
        "importance_sampling": -ratio * adv,
        "ppo": -np.minimum(ratio * adv, np.clip(ratio, 0.7, 1.3) * adv),
        "cispo": -np.clip(ratio, 0.7, 1.3) * lp * adv,
        "gspo": -np.minimum(seq * adv, np.clip(seq, 0.7, 1.3) * adv),
    }
    for name, terms in expected.items():
        cfg = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
        got = answer(trainer, datum(name, config=cfg, backward=False))
        np.testing.assert_allclose(got.elementwise_loss, terms, rtol=2e-4, atol=1e-6)
        assert got.ratio_deviation == pytest.approx(np.abs(ratio - 1).max(), rel=1e-4)
    # on-policy: the sampling logprobs are the forward's own, so every ratio is exactly 1
    on = datum("importance_sampling", backward=False)
    on.inputs["logprobs"] = ce.logprobs
    assert answer(trainer, on).ratio_deviation == 0.0


def test_published_adapter_serves_the_trained_bits(trainer: Trainer) -> None:
    answer(trainer, CreateRun("run", LoraSpec(RANK, seed=4)))
    answer(trainer, datum())
    answer(trainer, OptimStep("run", AdamSpec(learning_rate=0.05)))
    answer(trainer, Publish("run", "trained"))
    mine = answer(trainer, datum(backward=False)).logprobs
    # the served adapter's forward (runner/lora.py), as the scorer and the engine run it
    adapters = trainer.adapters
    adapters.select([adapters.by_name["trained"]])
    cache = BatchCache.for_prompts(trainer.templates, [0])
    logits = trainer.model(mx.array(TOKENS[:-1])[None], cache=cache.layers)[0]
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    served = np.array(mx.take_along_axis(lp, mx.array(TOKENS[1:])[:, None], axis=-1)[:, 0])
    np.testing.assert_allclose(mine, served, atol=1e-5)
    answer(trainer, CreateRun("base", LoraSpec(RANK, seed=4)))  # lora_b 0: the base model's
    d = datum(backward=False)
    fresh = answer(trainer, DatumPass("base", d.tokens, d.inputs, d.loss_fn, backward=False))
    assert np.abs(mine - fresh.logprobs).max() > 1e-3  # the step moved the trained run


def test_a_padded_batch_equals_its_datums_one_by_one(trainer: Trainer) -> None:
    answer(trainer, CreateRun("run", LoraSpec(RANK, seed=8)))
    run = trainer.run("run")
    key = mx.random.key(2)
    for p in run.params.values():  # lora_b non-zero: every layer's gradient is not 0
        key, sub = mx.random.split(key)
        p["lora_b"] = 0.05 * mx.random.normal(p["lora_b"].shape, key=sub)
    rng = np.random.default_rng(5)
    calls = [datum("ppo", rng.integers(3, 40000, n).astype(np.int32)) for n in (12, 4, 9)]
    alone = [answer(trainer, c) for c in calls]
    summed = flat(run.grads or {})
    run.grads = None
    together = answer(trainer, BatchPass(tuple(calls)))
    assert len(together) == 3
    for a, b in zip(alone, together):
        assert b.logprobs.shape == a.logprobs.shape
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
        np.testing.assert_allclose(b.elementwise_loss, a.elementwise_loss, rtol=1e-4, atol=1e-6)
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6)
        assert b.ratio_deviation == pytest.approx(a.ratio_deviation, rel=1e-4)
    grads = flat(run.grads or {})
    assert set(grads) == set(summed)
    for name, g in grads.items():
        np.testing.assert_allclose(np.array(g), np.array(summed[name]), rtol=1e-4, atol=1e-6)
    # a datum the vocabulary refuses refuses the whole batch, before any gradient
    run.grads = None
    bad = datum("ppo", np.array([5, 10**6, 3], np.int32))
    got = trainer.handle(BatchPass((calls[0], bad)))
    assert got.error and "vocabulary" in got.error and run.grads is None


def test_bad_calls_change_nothing(trainer: Trainer) -> None:
    answer(trainer, CreateRun("run", LoraSpec(RANK, seed=5)))
    bad = [
        datum("nope"),
        DatumPass("run", TOKENS[:-1], {"target_tokens": TOKENS[1:4]}, "cross_entropy"),
        DatumPass("gone", TOKENS[:-1], datum().inputs, "cross_entropy"),
        DatumPass(
            "run",
            np.array([10**6], np.int32),
            {"target_tokens": np.array([1]), "weights": np.array([1.0], np.float32)},
            "cross_entropy",
        ),  # fmt: skip
        CreateRun("x", LoraSpec(0)),
        CreateRun("x", LoraSpec(RANK, attn=False, mlp=False)),
        OptimStep("run", AdamSpec(learning_rate=-1)),
    ]
    for call in bad:
        got = trainer.handle(call)
        assert got.error and got.user, call
    assert trainer.run("run").grads is None and set(trainer.runs) == {"run"}


def test_checkpoint_round_trip_in_mlx_lm_format(
    trainer: Trainer, tiny_dir: Path, tmp_path: Path
) -> None:
    """save_weights writes mlx-lm's adapter format: mlx-lm's own loader and `--lora` read it,
    and a run loaded from it with its optimizer state takes the next step as the original."""
    answer(trainer, CreateRun("run", LoraSpec(RANK, seed=6, mlp=False)))
    adam = AdamSpec(learning_rate=0.02)
    answer(trainer, datum())
    answer(trainer, OptimStep("run", adam))
    ck = tmp_path / "ck"
    assert answer(trainer, SaveRun("run", str(ck), "tiny")) is None
    loaded = answer(trainer, LoadRun("copy", str(ck), optimizer=True, create=True))
    assert loaded.base == "tiny" and loaded.lora.rank == RANK and len(loaded.layers) == 8
    mine = answer(trainer, datum(backward=False)).logprobs
    # mlx-lm's loader (LoRALinear layers from adapter_config.json) gives the same logprobs
    model = load_model(str(tiny_dir)).model
    load_adapters(model, str(ck))
    logits = model(mx.array(TOKENS[:-1])[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = np.array(mx.take_along_axis(lp, mx.array(TOKENS[1:])[:, None], axis=-1)[:, 0])
    np.testing.assert_allclose(mine, ref, atol=1e-5)
    trainer.adapters.load("from-disk", str(ck))  # what `serve --lora NAME=DIR` does
    # the next step, on the run and on its copy: the same weights (the Adam moments came along)
    for run_id in ("run", "copy"):
        d = datum()
        answer(trainer, DatumPass(run_id, d.tokens, d.inputs, d.loss_fn))
        answer(trainer, OptimStep(run_id, adam))
    a, b = flat(trainer.run("run").params), flat(trainer.run("copy").params)
    for name in a:
        np.testing.assert_array_equal(np.array(a[name]), np.array(b[name]))
    # weights alone into an existing run; a checkpoint of another shape is refused
    answer(trainer, LoadRun("run", str(ck), optimizer=False, create=False))
    assert trainer.run("run").optimizer is None and trainer.run("run").steps == 1
    answer(trainer, CreateRun("other", LoraSpec(RANK + 1, seed=6)))
    got = trainer.handle(LoadRun("other", str(ck), optimizer=False, create=False))
    assert got.error and "rank" in got.error
    got = trainer.handle(LoadRun("x", str(tmp_path / "none"), optimizer=False, create=True))
    assert got.error and "no checkpoint" in got.error
