"""The training runs a server holds, in the engine's process, and each call of
training/calls.py done on the engine's thread between two steps (engine/engine.py's `Train`):
serving goes on between calls, and a call is at most one padded batch of datums' forward and
backward (as many as engine/trainings.py admits), or one optimizer step, or a publish.

A datum's forward is the one runner/scorer.py computes (through a batch cache, left-padded as
the engine pads a group of prompts it prefills together, the logits in float32, the target
tokens' logprobs extracted on the host as the sampler extracts them), so that in
batch-invariant mode the logprobs `forward` returns are the bits `sample` returned for the same
tokens. Its gradient traces the same forward, with the loss's log-softmax in MLX. Gradients add
up over `forward_backward` calls until `optim_step`, as Tinker's do; the optimizer is mlx's
AdamW with bias correction, as `AdamParams` describes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from omlx_logprobs.logprobs.extract import HostExtraction
from omlx_logprobs.runner import query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.lora import BASE, AdapterError, AdapterSet, layer_dims
from omlx_logprobs.training import checkpoint, losses
from omlx_logprobs.training.calls import (
    AdamSpec,
    BatchPass,
    CreateRun,
    DatumPass,
    DatumResult,
    DropRun,
    Loaded,
    LoadRun,
    OptimStep,
    Publish,
    SaveRun,
    TrainAnswer,
    TrainCall,
)
from omlx_logprobs.training.checkpoint import CheckpointError
from omlx_logprobs.training.lora import LoraError, Params, TrainableLora

log = logging.getLogger("omlx_logprobs")
A = TypeVar("A")


class TrainingError(ValueError):
    """The call cannot be done as asked (the message says why); nothing changed."""


@dataclass
class Run:
    lora: TrainableLora
    params: Params
    grads: Params | None = None  # summed since the last optimizer step
    optimizer: optim.AdamW | None = None
    steps: int = 0
    published: list[str] = field(default_factory=list)


class Trainer:
    def __init__(self, model: Any, adapters: AdapterSet, templates: list[Any], vocab: int):
        self.model, self.adapters, self.templates, self.vocab = model, adapters, templates, vocab
        self.runs: dict[str, Run] = {}

    def handle(self, call: TrainCall) -> TrainAnswer:
        """Do the call; its answer, or why not (a fault of the call's, or of the server's)."""
        return self.answer(self._do, call)

    def answer(self, fn: Callable[[A], Any], arg: A) -> TrainAnswer:
        """fn(arg) as a call's answer: its value, or why not."""
        try:
            return TrainAnswer(fn(arg))
        except (TrainingError, LoraError, losses.LossError, AdapterError, CheckpointError) as exc:
            return TrainAnswer(error=str(exc))
        except Exception as exc:  # the server's fault: the run stays as it was before the call
            log.exception("training call %s failed", type(arg).__name__)
            return TrainAnswer(error=f"internal error in training: {exc}", user=False)

    def _do(self, call: TrainCall) -> Any:
        match call:
            case CreateRun(run_id=run_id, lora=spec):
                lora = TrainableLora(self.model, spec)
                self.runs[run_id] = Run(lora, lora.initial())
                return sorted(lora.layers)
            case DatumPass():
                return self.datum(call)
            case BatchPass(passes=passes):
                return self.datums(list(passes))
            case OptimStep(run_id=run_id, adam=adam):
                return self.step(self.run(run_id), adam)
            case Publish(run_id=run_id, name=name):
                run = self.run(run_id)
                self.adapters.put(
                    name, f"tinker:{run_id}", run.lora.scale, run.lora.served(run.params),
                    replace=name in self.adapters.by_name,
                )  # fmt: skip
                run.published.append(name)
                return name
            case DropRun(run_id=run_id):
                self.runs.pop(run_id, None)
                return None
            case SaveRun(run_id=run_id, directory=d, base=base, optimizer=with_state):
                run = self.run(run_id)
                state = run.optimizer.state if with_state and run.optimizer else None
                checkpoint.write(Path(d), run.lora, run.params, base, run.steps, state)
                return None
            case LoadRun():
                return self.load(call)
        raise TrainingError(f"unknown training call {type(call).__name__}")

    def load(self, call: LoadRun) -> Loaded:
        ck = checkpoint.read(Path(call.directory), call.optimizer)
        lora = TrainableLora(self.model, ck.spec)
        for path, layer in lora.layers.items():
            in_dims, out_dims, _ = layer_dims(layer)
            p = ck.params.get(path, {})
            a, b = p.get("lora_a"), p.get("lora_b")
            want = ((in_dims, ck.spec.rank), (ck.spec.rank, out_dims))
            if a is None or b is None or (tuple(a.shape), tuple(b.shape)) != want:
                raise TrainingError(f"{call.directory} does not fit this model at {path}")
        if len(ck.params) != len(lora.layers):
            raise TrainingError(f"{call.directory} adapts layers this model does not have")
        if not call.create:
            run = self.run(call.run_id)
            if sorted(run.lora.layers) != sorted(lora.layers) or run.lora.spec.rank != ck.spec.rank:
                raise TrainingError(
                    f"{call.directory} has another LoRA shape (rank {ck.spec.rank}) than the run"
                )
            lora = run.lora
        opt = None
        if ck.optimizer is not None:
            opt = optim.AdamW(learning_rate=0.0, bias_correction=True)
            opt.state = ck.optimizer
        self.runs[call.run_id] = Run(lora, ck.params, optimizer=opt, steps=ck.steps)
        return Loaded(ck.base, ck.spec, sorted(lora.layers))

    def run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise TrainingError(f"no training run {run_id!r} (created on this server)")
        return run

    # ---- datums -----------------------------------------------------------------------------
    def logits(self, run: Run, params: Params, tokens: mx.array, pads: list[int]) -> mx.array:
        """[B, W, V] float32: the model's logits of the left-padded rows `tokens` with the run's
        adapter, as runner/scorer.py computes them and as the engine prefills a group of
        prompts (a batch cache padded by `pads`; served adapters off for this forward)."""
        self.adapters.select([BASE])
        with run.lora.attached(params), query_blocks.differentiable():
            cache = BatchCache.for_prompts(self.templates, pads)
            out = self.model(tokens, cache=cache.layers)
        return out.astype(mx.float32)

    def datum(self, call: DatumPass) -> DatumResult:
        return self.datums([call])[0]

    def check(self, calls: list[DatumPass]) -> None:
        """TrainingError for a datum the run, the loss or the vocabulary refuses (before any
        forward: a refused call adds no gradient)."""
        for call in calls:
            self.run(call.run_id)
            self._inputs(call)

    def datums(self, calls: list[DatumPass]) -> list[DatumResult]:
        """Datums of one run, loss and direction in one forward (and backward): left-padded
        into one batch, each row's loss on its own positions, their sum's gradients added to
        the run's. A row's logits are those of its datum alone (in batch-invariant mode the
        same bits: runner/invariance.py checks a prompt batched against alone)."""
        first = calls[0]
        if any((c.run_id, c.loss_fn, c.backward) != (first.run_id, first.loss_fn, first.backward)
               for c in calls):  # fmt: skip
            raise TrainingError("the datums of one pass share their run, loss and direction")
        run = self.run(first.run_id)
        rows = [self._inputs(c) for c in calls]
        width = max(len(c.tokens) for c in calls)
        pads = [width - len(c.tokens) for c in calls]
        tokens = mx.array(
            np.stack([np.pad(c.tokens.astype(np.int32), (p, 0)) for c, p in zip(calls, pads)])
        )
        fn = losses.LOSSES[first.loss_fn][0]

        # On MLX's CPU backend each row's logprobs come from the engine's host extraction of
        # its logits (the bits `sample` returns); on a device the chosen ids' log-softmax stays
        # there (the [W, V] logits of every datum copied out had taken 7x mlx-lm's step).
        on_host = mx.default_device() == mx.cpu

        def loss_of(params: Params) -> tuple[mx.array, list[mx.array], list[mx.array], mx.array]:
            logits = self.logits(run, params, tokens, pads)
            lp_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            terms, chosen = [], []
            for i, (p, (_, x)) in enumerate(zip(pads, rows)):
                lp = mx.take_along_axis(lp_all[i, p:], x["target_tokens"][:, None], axis=-1)
                chosen.append(lp[:, 0])
                terms.append(fn(lp[:, 0], x, first.config))
            return sum((t.sum() for t in terms), mx.array(0.0)), terms, chosen, logits

        if first.backward:
            (_, terms, chosen, logits), grads = mx.value_and_grad(loss_of)(run.params)
            total = grads if run.grads is None else tree_map(mx.add, run.grads, grads)
            mx.eval(terms, [logits] if on_host else chosen, total)
        else:
            _, terms, chosen, logits = loss_of(run.params)
            mx.eval(terms, [logits] if on_host else chosen)
            total = run.grads
        run.grads = total
        out = []
        for i, (call, p, (_, x)) in enumerate(zip(calls, pads, rows)):
            if on_host:
                host = HostExtraction(logits[i, p:], x["target_tokens"], 0, None, True).to_host()
                lp = np.asarray(host.logprobs, dtype=np.float32)
            else:
                lp = np.array(chosen[i], dtype=np.float32)
            out.append(DatumResult(lp, np.array(terms[i], dtype=np.float32),
                                   float(terms[i].sum()), _deviation(lp, call.inputs)))  # fmt: skip
        return out

    def _inputs(self, call: DatumPass) -> tuple[mx.array, dict[str, mx.array]]:
        names = losses.needs(call.loss_fn)
        n = len(call.tokens)
        if call.tokens.ndim != 1 or n == 0:
            raise TrainingError("a datum's model_input must hold at least one token")
        x: dict[str, mx.array] = {}
        for name in names:
            v = call.inputs.get(name)
            if v is None:
                raise TrainingError(
                    f"the {call.loss_fn} loss needs loss_fn_inputs[{name!r}] (it reads "
                    f"{', '.join(names)})"
                )
            if v.shape != (n,):
                raise TrainingError(
                    f"loss_fn_inputs[{name!r}] has shape {list(v.shape)}; the datum's "
                    f"model_input has {n} tokens, so it must be [{n}]"
                )
            x[name] = mx.array(v.astype(np.int32 if name == "target_tokens" else np.float32))
        for what, ids in (("model_input", call.tokens), ("target_tokens", call.inputs[names[0]])):
            if ids.min() < 0 or ids.max() >= self.vocab:
                raise TrainingError(f"{what} holds ids outside the vocabulary [0, {self.vocab})")
        return mx.array(call.tokens.astype(np.int32)), x

    # ---- the optimizer -----------------------------------------------------------------------
    def step(self, run: Run, adam: AdamSpec) -> dict[str, float]:
        ok = adam.learning_rate >= 0 and 0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1
        if not (ok and adam.eps >= 0 and adam.weight_decay >= 0 and adam.grad_clip_norm >= 0):
            raise TrainingError(
                "AdamParams: learning_rate, eps, weight_decay and grad_clip_norm >= 0, betas"
                " in [0, 1)"
            )
        grads = run.grads if run.grads is not None else tree_map(mx.zeros_like, run.params)
        # a bound of inf scales by exactly 1.0: the norm alone
        grads, norm = optim.clip_grad_norm(grads, adam.grad_clip_norm or math.inf)
        if run.optimizer is None:
            run.optimizer = optim.AdamW(learning_rate=adam.learning_rate, bias_correction=True)
        opt = run.optimizer
        opt.learning_rate = adam.learning_rate
        opt.betas = [adam.beta1, adam.beta2]
        opt.eps, opt.weight_decay = adam.eps, adam.weight_decay
        run.params = opt.apply_gradients(grads, run.params)
        mx.eval(run.params, opt.state, norm)
        run.grads = None
        run.steps += 1
        return {"grad_norm": float(norm), "learning_rate": adam.learning_rate}


def _deviation(lp: np.ndarray, inputs: dict[str, np.ndarray]) -> float | None:
    """The largest |exp(lp - sampling logprob) - 1| over the sampled positions (those with a
    sampling logprob or an advantage; a prompt's have neither), or None without them."""
    sampled = inputs.get("logprobs")
    if sampled is None:
        return None
    mask = sampled != 0
    if "advantages" in inputs:
        mask |= inputs["advantages"] != 0
    if not mask.any():
        return None
    diff = lp[mask].astype(np.float64) - sampled[mask].astype(np.float64)
    return float(np.abs(np.expm1(diff)).max())
