"""Speculative decoding whose every emitted token and logprob entry is the target model's own
(docs/specs/speculation.md).

A speculative step feeds each decoding row `[last token, d1..dK]` through the target in one
forward (rows padded to the step's K; a row without a draft pads too). Each of the K+1 positions
is then processed exactly as a plain step would process it with the drafts before it taken as
sampled: the token mask (grammar, min_tokens, bad words), logit bias and penalties over the
extended history, temperature and truncation, and the sample itself with the key of that
position's step (`step_key(seed, num_sampled + j, choice)`). A draft token is accepted while it
equals the target's own sample at its position; the first position where they differ emits the
target's sample, as does the position after the last draft (the bonus token).

Drafts here are deterministic (a prediction, prompt lookup): for a one-hot draft distribution
this is rejection sampling exactly (accept d with probability p(d); on rejection, p with d
removed), and more: with a seed, the output is the very one the request gets without
speculation, since every position draws with the same key from the same distribution. Every
emitted token's entries come from the same extraction over the same logits as a plain step's.

The step is synchronous: drafts follow from the last processed token, so the engine processes
the step in flight before launching one (Engine._needs_history), and the rows' rejected
positions leave the KV cache when it is collected (BatchCache.rollback).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from omlx_logprobs.batch.budget import budgeted, forced_token
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.logprobs.extractor import Extractor
from omlx_logprobs.models.draft import vocabulary_mismatch
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.runner import verify
from omlx_logprobs.runner.batch_state import BatchState
from omlx_logprobs.runner.draft_model import DraftModel, step_seconds
from omlx_logprobs.runner.drafts import RowDrafts
from omlx_logprobs.runner.grammar import open_ended
from omlx_logprobs.runner.plan import Plan
from omlx_logprobs.runner.sampler import draw, token_mask
from omlx_logprobs.runner.step import LaunchedStep, StepResult
from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary

__all__ = ["MODES", "SpecStep", "Speculator", "Target", "speculator"]

log = logging.getLogger("omlx_logprobs")

MODES = ("off", "prediction", "lookup", "draft")
# A row keeps drafting while its running mean of tokens emitted per verify step stays at or
# above that step's cost in plain steps (`Speculator._cost`), which scales the cost of a verify
# of K drafts in one row, measured at start-up on the served model (`speculator`): it depends
# on the backend and on the weights' format. MLX's CPU backend computes every position (2.7 for
# 9 positions); MLX's CUDA backend on sm90 takes its one-row quantized kernel for exactly one
# row and a tiled matmul from two (4 bits: 2.4 bare, 3.4 in the server on an H200), while a
# bfloat16 model's matmul reads the weights once for every position; MLX's Metal backend serves
# up to 12-33 rows with its one-row quantized kernel (docs/specs/speculation.md).
CPU_BREAK_EVEN = 2.7  # 9 positions, bench/experiments/verify_cost.py
# Below it, the row decodes plainly for this many steps, doubled at each further miss.
COOLDOWN, MAX_COOLDOWN = 4, 256
EMA = 0.3  # the weight of the last verify step in that mean
# A row whose sources found no draft this many steps running rests as well.
MAX_MISSES = 8
# Tests set this to warm the speculative shapes at start-up on the CPU too (Engine's
# `_warm_speculation`; on a GPU it always runs).
WARM_ON_CPU = False
# A draft model's acceptance rate per row, before its first verify: 4 of 5 (taken, tried);
# and the weight of the last verify in its running sums.
PRIOR_TAKEN, PRIOR_TRIED = 4.0, 5.0
RATE_EMA = 0.2


class Target(Protocol):
    """What a speculative step needs of the runner (runner/model_runner.py) beside its batch."""

    vocab_size: int
    stop_ids: tuple[int, ...]  # EOS ids: what min_tokens holds back besides stop_token_ids
    extractor: Extractor

    def forward_batch(self, inputs: mx.array, width: int = 0) -> mx.array:
        """The batch rows' logits for `inputs` [B, n], `width` columns reserved first."""
        ...

    def queue(self, *arrays: Any) -> None:
        """Queue arrays on the device (timed)."""
        ...


def speculator(cfg: EngineConfig, plan: Plan, model: Any, vocab: Vocabulary) -> Speculator | None:
    """The speculator of a runner with this plan, serving `model`, as configured, or None (off,
    or a model that cannot: Plan.why_no_speculation); a draft model that does not share the
    served model's tokenizer is a ValueError."""
    if cfg.speculate == "off":
        return None
    if plan.why_no_speculation is not None:
        log.info("speculative decoding off for this model: %s", plan.why_no_speculation)
        return None
    draft = None
    if cfg.draft_model is not None:
        loaded = load_model(cfg.draft_model, dtype=cfg.dtype)
        bad = vocabulary_mismatch(vocab, loaded.vocab, len(loaded.tokenizer))
        if bad is not None:
            raise ValueError(f"--draft-model {cfg.draft_model}: {bad}")
        draft = DraftModel(loaded.model, len(vocab))
        log.info("draft model: %s", cfg.draft_model)
    spec = Speculator(cfg.speculate, cfg.num_draft_tokens, cfg.speculate_max_batch, draft)
    # What a one-row verify of K drafts (K + 1 positions) and a draft model's step cost in plain
    # steps here, each timed as a forward over a short cache; on MLX's CPU backend the verify's
    # is CPU_BREAK_EVEN (it computes every position, whatever the weights' format).
    k, gpu = cfg.num_draft_tokens, mx.default_device() == mx.gpu
    spec.warms = gpu or WARM_ON_CPU
    plain = step_seconds(model) if gpu or draft is not None else 0.0
    if gpu:
        spec.break_even = max(1.0, step_seconds(model, width=k + 1) / plain)
        log.info("speculation: a verify of %d drafts costs %.2f plain steps", k, spec.break_even)
    if draft is not None:
        spec.draft_cost = step_seconds(draft.model) / plain
        log.info("draft model: a step costs %.2f of the served model's", spec.draft_cost)
    return spec


@dataclass(frozen=True)
class SpecStep:
    """What a speculative step's collection needs: each row's drafts, the padded width K, and
    which rows drafted from their prediction."""

    drafts: list[verify.Drafts]
    width: int
    predicted: list[bool]


@dataclass
class _Row:
    drafts: RowDrafts
    mean: float  # tokens emitted per verify step, running
    pause: int = 0  # plain steps left before it drafts again
    cooldown: int = COOLDOWN
    misses: int = 0  # steps in a row with no draft found
    # A draft model's drafts cost one of its steps each; how many it proposes follows from
    # its running rate of taken drafts in this row (`Speculator._length`): drafts taken, and
    # tried (taken ones and the rejection that ended a verify).
    taken: float = PRIOR_TAKEN
    tried: float = PRIOR_TRIED
    modeled: bool = False  # the last drafts came from the draft model

    def rest(self) -> None:
        """Decode plainly for a while (on a GPU with the step overlap back), longer each time."""
        self.pause, self.cooldown = self.cooldown, min(2 * self.cooldown, MAX_COOLDOWN)
        self.misses = 0


class Speculator:
    def __init__(
        self, mode: str, num_draft: int, max_batch: int, draft: DraftModel | None = None
    ) -> None:
        assert mode in MODES[1:] and (mode == "draft") == (draft is not None)
        self.lookup = mode == "lookup"
        self.k = num_draft
        self.max_batch = max_batch
        self.draft = draft
        self.break_even = CPU_BREAK_EVEN  # a GPU's is timed by `speculator`
        self.draft_cost = 0.0  # a draft model's step in plain steps of the target (`speculator`)
        self._rows: dict[int, _Row] = {}
        self.warms = False  # whether the engine warms the speculative shapes (`speculator`)
        self._forced: list[int] = []  # draft widths the next verifies take (`force`)
        self.drafted = self.accepted = 0  # draft tokens verified, and accepted (/metrics)

    @contextmanager
    def forcing(self) -> Iterator[int]:
        """Within it, the next verifies draft K, K-1, ..., 1 tokens, whatever row drafts (the
        engine's start-up warm runs one request alone): a verify of every width meets its
        shapes once. Yields the tokens a request needs to reach them all (each verify emits
        at most its width and one); widths left at its end (a fault) are dropped, so no
        client's row takes them."""
        self._forced = list(range(1, self.k + 1))
        try:
            yield self.k * (self.k + 3) // 2 + 2
        finally:
            self._forced = []

    def warm_draft(self) -> None:
        """The draft model's every first feed (1 to K + 1 new ids) and a step, once each."""
        if self.draft is not None:
            self.draft.warm(self.k)

    def _may(self, s: Sequence) -> bool:
        return self.lookup or self.draft is not None or bool(s.params.prediction)

    def wants(self, running: list[Sequence]) -> bool:
        """Whether the next step may speculate (then the step in flight is processed first)."""
        if not 0 < len(running) <= self.max_batch:
            return False
        return bool(self._forced) or any(
            self._may(s) and not self._resting(s) and self._promising(s) for s in running
        )

    def _promising(self, s: Sequence) -> bool:
        """A draft model always proposes; a prediction or lookup where its last tokens match."""
        if self.draft is not None:
            return True
        return self._row(s).drafts.promising(s.prompt_ids, s.output_ids)

    def _resting(self, s: Sequence) -> bool:
        row = self._rows.get(s.seq_id)
        return row is not None and row.pause > 0

    def _row(self, s: Sequence) -> _Row:
        row = self._rows.get(s.seq_id)
        if row is None:
            drafts = RowDrafts(s.prompt_ids, s.params.prediction, self.lookup)
            row = self._rows[s.seq_id] = _Row(drafts, float(self.k + 1))
        return row

    def _draft(self, s: Sequence) -> tuple[verify.Drafts, bool]:
        if self._forced:  # the last token repeated: what the drafts are does not matter
            width = min(self._forced.pop(), s.params.max_tokens - s.num_sampled - 1)
            return [s.output_ids[-1]] * width, False
        if not self._may(s) or open_ended(s.params.constraint) or budgeted(s):
            return [], False
        row = self._row(s)
        if row.pause > 0:
            return [], False
        # Emitted tokens never pass max_tokens: K drafts emit at most K + 1.
        k = min(self.k, s.params.max_tokens - s.num_sampled - 1)
        drafts, predicted = row.drafts.draft(s.prompt_ids, s.output_ids, k)
        row.modeled = not drafts and self.draft is not None and k > 0
        if row.modeled:
            assert self.draft is not None
            context = s.prompt_ids + s.output_ids.tolist()
            proposed = self.draft.propose(s.seq_id, context, min(k, self._length(row)))
            if not verify.reads_drafts(s):  # left on the device, read with the verify's result
                row.misses = 0
                return proposed, predicted
            drafts = verify.read(proposed)
        row.misses = 0 if drafts or k <= 0 else row.misses + 1
        if row.misses >= MAX_MISSES:
            row.rest()
        return drafts, predicted

    def launch(self, batch: BatchState, target: Target) -> LaunchedStep | None:
        """A speculative step for the decoding rows, queued; None where a plain step is due (a
        large batch, a step not processed yet, no row with a draft)."""
        rows = batch.rows
        if not 0 < len(rows) <= self.max_batch:
            return None
        for s in rows:  # a resting row's pause counts steps, plain ones included
            row = self._rows.get(s.seq_id)
            if row is not None and row.pause > 0:
                row.pause -= 1
        if any(s.num_sampled != len(s.output_ids) for s in rows):
            return None
        if any(forced_token(s, s.num_sampled) is not None for s in rows):
            return None  # a forced token: a plain step (token_mask forces it there)
        live = {s.seq_id for s in rows}
        for gone in [i for i in self._rows if i not in live]:
            del self._rows[gone]
        if self.draft is not None:
            self.draft.forget(live)
        made = [self._draft(s) for s in rows]
        drafts = [d for d, _ in made]
        if not any(len(d) for d in drafts):
            return None
        known = [d if isinstance(d, list) else [] for d in drafts]  # what the host reads
        verify.grammar_trim(rows, known)
        width = max(len(d) for d in drafts)
        if width == 0:
            return None
        bits = verify.grammar_bits(rows, known, width, target.vocab_size)
        n = width + 1
        inputs = verify.ids(rows, drafts, width)
        logits = target.forward_batch(inputs, n)
        raw = logits.reshape(len(rows) * n, logits.shape[-1]).astype(mx.float32)
        params = [s.params for s in rows for _ in range(n)]
        states, histories, keys = verify.positions(rows, known, n)
        masked = token_mask(raw, params, states, target.stop_ids, None, bits)
        tokens, dist = draw(masked, params, histories, keys)
        pending = target.extractor.step(tokens, raw, dist, params)
        target.queue(tokens, *pending.arrays())
        spec = SpecStep(drafts, width, [p for _, p in made])
        return LaunchedStep(list(rows), pending, spec=spec)

    def collect(self, batch: BatchState, step: LaunchedStep, spec: SpecStep) -> StepResult:
        """The accepted drafts and each row's next token, as one result row per emitted token
        (a row's tokens in order); rejected positions leave the cache."""
        assert step.sampled is not None
        tokens, finite, entries = step.sampled.to_host()
        n = spec.width + 1
        picked: list[int] = []
        seqs: list[Sequence] = []
        predicted: list[bool] = []
        unused: list[int] = []
        last: list[int] = []
        for i, s in enumerate(step.seqs):
            d, base = verify.read(spec.drafts[i]), i * n
            m = 0
            while m < len(d) and finite[base + m] and tokens[base + m] == d[m]:
                m += 1
            picked += range(base, base + m + 1)
            seqs += [s] * (m + 1)
            predicted += [bool(d) and spec.predicted[i]] * m + [False]
            unused.append(spec.width - m)
            last.append(int(tokens[base + m]))
            s.num_sampled += m + 1
            if d:
                self.drafted += len(d)
                self.accepted += m
                self._score(s, m + 1, len(d))
                if spec.predicted[i]:  # accepted ones: as the output takes them
                    s.rejected_prediction_tokens += len(d) - m
        assert batch.cache is not None
        batch.cache.rollback(unused)
        batch.sampled(mx.array(last, dtype=mx.int32), step.seqs)
        sel = np.array(picked, dtype=np.int64)
        lp = None if entries is None else Entries(*(a[sel] for a in entries.arrays()))
        return StepResult(seqs, tokens[sel], finite[sel], lp, predicted=np.array(predicted))

    def _cost(self, drafted: int, modeled: bool) -> float:
        """A verify step of `drafted` drafts in plain steps: 1 + (break_even - 1) d / K (as
        measured at K), and a draft model's d steps on top."""
        return 1 + (self.break_even - 1) * drafted / self.k + modeled * drafted * self.draft_cost

    def _length(self, row: _Row) -> int:
        """A draft model's proposal length for this row: the k that makes the most tokens per
        plain step of cost, (1 - a^(k+1)) / (1 - a) / cost(k), where a is the row's running
        rate of taken drafts (a draft is taken with probability a once all before it were).
        A draft model that is always wrong proposes one draft a try."""
        a = min(row.taken / row.tried, 0.99)
        rates = [
            ((1 - a ** (k + 1)) / (1 - a) / self._cost(k, True), k) for k in range(1, self.k + 1)
        ]
        return max(rates)[1]

    def _score(self, s: Sequence, emitted: int, drafted: int) -> None:
        """The per-row off rule: a row whose drafts stop paying their cost pauses, longer each
        time, and starts again even (its mean at the cost of its next try)."""
        row = self._rows.get(s.seq_id)
        if row is None:
            return
        cost = self._cost(drafted, row.modeled)
        if row.modeled:
            taken = emitted - 1
            row.taken = (1 - RATE_EMA) * row.taken + RATE_EMA * taken
            row.tried = (1 - RATE_EMA) * row.tried + RATE_EMA * (taken + (taken < drafted))
        row.mean = (1 - EMA) * row.mean + EMA * emitted
        if row.mean >= cost:
            row.cooldown = COOLDOWN
            return
        row.rest()
        row.mean = self._cost(self._length(row) if row.modeled else self.k, row.modeled)
