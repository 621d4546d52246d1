"""Training calls in the engine (training/calls.py, carried by engine/commands.py's `Train`):
queued in the order they came, each done between two steps on the engine's thread
(training/trainer.py), after which the requests that wait have the engine for SERVE_SHARE times
as long as the call took: serving keeps at least half the engine's time while training runs.

A forward_backward's datums (a `BatchPass`) go in padded forwards of as many as are admitted
when each runs, as a request is admitted: at most a prefill step's tokens (the step's bound on
the engine's time), and within the memory free beside what the weights and the batch hold then
(MLX's active memory). Datums that do not fit wait while requests run and will free theirs; with
none running, nothing will, and the call fails saying how much it needed.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx

from omlx_logprobs.training.calls import BatchPass, DatumPass, DatumResult, TrainAnswer, TrainCall
from omlx_logprobs.training.trainer import Trainer

# After a training call of d seconds, requests that wait have the engine for SERVE_SHARE * d
# before the next call.
SERVE_SHARE = 1.0


@functools.cache
def device_memory() -> int:
    """The bytes MLX may hold: the machine's memory (a Mac's unified memory, as the requests'
    budget of models/footprint.py counts it), or a GPU's own where it reports less."""
    import psutil

    total = int(psutil.virtual_memory().total)
    own = mx.device_info().get("memory_size")
    return min(total, int(own)) if isinstance(own, int) and own > 0 else total


def free_memory() -> int:
    """What a training forward may take now: the device's memory less MLX's active memory
    (the weights, the batch's keys and values, the kept prefixes, the runs' own weights)."""
    return device_memory() - int(mx.get_active_memory())


def admitted(passes: list[DatumPass], tokens: int, free: int, token_bytes: int) -> int:
    """How many of `passes`, from the first, one padded forward takes: its rows times its
    longest row within `tokens` (one datum always) and, at `token_bytes` a token, within
    `free` bytes (perhaps none)."""
    count, width = 0, 0
    for p in passes:
        width = max(width, len(p.tokens))
        size = (count + 1) * width
        if (count and size > tokens) or size * token_bytes > free:
            break
        count += 1
    return count


@dataclass
class _Queued:
    call: TrainCall
    done: Future[TrainAnswer]
    results: list[DatumResult] = field(default_factory=list)  # a BatchPass's, so far


class Trainings:
    def __init__(
        self,
        make: Callable[[], Trainer | None],
        tokens: int,
        memory: Callable[[], int] = free_memory,
    ) -> None:
        """`make`: the trainer of the engine's model, made at the first call (None: this
        model cannot be trained here); `tokens`: a forward's bound (the prefill chunk);
        `memory`: the bytes free now."""
        self._make, self.tokens, self.memory = make, tokens, memory
        self.trainer: Trainer | None = None
        self.queue: deque[_Queued] = deque()
        self._serve_until = 0.0
        self.forwards = 0  # training forwards run (each a padded batch of datums)

    def post(self, call: TrainCall, done: Future[TrainAnswer]) -> None:
        self.queue.append(_Queued(call, done))

    def due(self, serving: bool) -> bool:
        """Whether a call may run now: one waits, and no request is running (`serving`
        False) or requests have had their share since the last call."""
        return bool(self.queue) and (not serving or time.monotonic() >= self._serve_until)

    def run(self, asleep: bool, serving: bool) -> bool:
        """The next call, or its next forward; False when nothing ran (its datums wait for
        the memory the running requests hold)."""
        head = self.queue[0]
        if asleep:  # at level 2 there are no weights to train on
            self._answer(TrainAnswer(error="the model is asleep: POST /wake_up first"))
            return True
        if self.trainer is None:
            self.trainer = self._make()
            if self.trainer is None:
                self._answer(TrainAnswer(error="this model cannot be trained here", user=False))
                return True
        t0 = time.monotonic()
        if isinstance(head.call, BatchPass):
            ran = self._forward(head, head.call, serving)
        else:
            self._answer(self.trainer.handle(head.call))
            ran = True
        if ran:
            now = time.monotonic()
            self._serve_until = now + SERVE_SHARE * (now - t0)
        return ran

    def close(self, why: str) -> None:
        while self.queue:
            self._answer(TrainAnswer(error=why, user=False))

    def _forward(self, head: _Queued, call: BatchPass, serving: bool) -> bool:
        assert self.trainer is not None
        passes = list(call.passes)
        if not head.results:  # refused before any gradient is added
            answer = self.trainer.answer(self.trainer.check, passes)
            if answer.error is not None:
                self._answer(answer)
                return True
        left = passes[len(head.results) :]
        free = self.memory() if call.token_bytes else 1 << 62
        count = admitted(left, self.tokens, free, call.token_bytes)
        if not count:
            if serving:  # the batch's requests will free what they hold
                return False
            need = len(left[0].tokens) * call.token_bytes
            self._answer(TrainAnswer(
                error=f"a forward and backward of {len(left[0].tokens)} tokens needs about"
                      f" {need >> 20} MiB; {max(free, 0) >> 20} MiB are free beside the weights"
                      " and what the engine keeps: send shorter datums"
            ))  # fmt: skip
            return True
        answer = self.trainer.handle(BatchPass(tuple(left[:count])))
        self.forwards += 1
        if answer.error is not None:
            self._answer(answer)
        else:
            head.results += answer.value
            if len(head.results) == len(passes):
                self._answer(TrainAnswer(head.results))
        return True

    def _answer(self, answer: TrainAnswer) -> None:
        self.queue.popleft().done.set_result(answer)
