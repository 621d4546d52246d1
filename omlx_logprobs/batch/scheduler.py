"""Which requests run in the next step. Plain Python over Sequence objects: no model, no mlx.

Prompts wait in vLLM's priority order: lower `priority` first, ties by arrival; a prompt between
its prefill chunks stays first (vLLM counts it as running). When the batch has no rows for the
first waiting prompt and some running choices have a strictly lower priority (a higher value),
the lowest of them are preempted (`preempts`): the engine retracts them, and they prefill again
from their prompt and output once there is room (vLLM's preemption by recompute).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from omlx_logprobs.batch.sequence import Sequence, Status


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end >= self.seq.prompt_len


@dataclass
class SchedulerOutput:
    """One step's work: decode every running sequence, and prefill prompt chunks within the
    step's token budget, oldest prompt first. Only the last chunk of the list may be partial.
    A chunk of a prompt with forks (n choices) is theirs too."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        prefill_chunk: int,
        prefill_delay_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        cached: Callable[[Sequence], int] = lambda seq: 0,
        waits: Callable[[Sequence, list[Sequence]], bool] = lambda seq, busy: False,
        whole_runs: bool = False,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        # A prompt's chunk never ends inside a run of an image's placeholders: the model's
        # images attend to each other both ways in the prefill (Gemma 3's), so one forward
        # must hold each run whole.
        self.whole_runs = whole_runs
        # Prompt tokens a whole prompt would take from the runner's prefix cache, not compute.
        self.cached = cached
        # Whether a prompt is better off a step later, when prompts prefilling now (the second
        # argument) are kept in the runner's prefix cache (a scored prompt: with their entries).
        self.waits = waits
        self.prefill_chunk = prefill_chunk
        self.prefill_delay_s = prefill_delay_s
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.arrivals: dict[int, float] = {}  # seq_id -> when it was added
        self.running: list[Sequence] = []
        self.scored: list[Sequence] = []  # prefilled with max_tokens 0: done once processed
        # Sequence.arrival: new prompts count up; retracted ones count down, ahead of them.
        self._arrived = itertools.count(1)
        self._retracted = itertools.count(0, -1)

    def add(self, seq: Sequence) -> None:
        arrival = next(self._arrived)
        for member in seq.group:  # a fork retracted later keeps its prompt's place
            member.arrival = arrival
        self._enqueue(seq)
        self.arrivals[seq.seq_id] = self.clock()

    def _enqueue(self, seq: Sequence) -> None:
        """Into `waiting` in (priority, arrival) order, behind the prompts between chunks."""
        key = _order(seq)
        if not self.waiting or _order(self.waiting[-1]) <= key:
            self.waiting.append(seq)  # the usual case: one priority, in arrival order
            return
        at = next(i for i, s in enumerate(self.waiting) if _order(s) > key)
        self.waiting.insert(at, seq)

    def preempts(self) -> list[Sequence]:
        """The running choices to retract so that the first waiting prompt (its rows, and those
        of the prompts between chunks ahead of it) gets into the batch: the lowest-priority
        ones (latest arrived first) whose priority is strictly lower than its, and only when
        they free enough rows; none when it fits, or nothing running is lower."""
        need = len(self.running) - self.max_num_seqs
        for seq in self.waiting:
            need += len(seq.group)
            if not seq.num_prefilled:
                break
        else:
            return []
        if need <= 0:
            return []
        lower = [s for s in self.running if s.priority > seq.priority]
        if len(lower) < need:
            return []
        lower.sort(key=lambda s: (s.priority, s.arrival), reverse=True)
        return lower[:need]

    def prefill_due(self) -> bool:
        """Whether this step prefills. While a batch decodes, new prompts wait up to
        `prefill_delay_s` for company: each prefill is a forward of its own, whose fixed cost
        (on a GPU, launching every layer's kernels) is worth paying for several prompts at once."""
        if not self.waiting:
            return False
        oldest = self.waiting[0]
        if not self.running or oldest.num_prefilled or self.prefill_delay_s <= 0:
            return True
        if len(self.waiting) >= self.max_num_seqs - len(self.running):
            return True  # enough to fill the batch
        tokens = 0
        for s in self.waiting:  # enough to fill the step's budget
            tokens += s.prompt_len
            if tokens >= self.prefill_chunk:
                return True
        return self.clock() - self.arrivals.get(oldest.seq_id, 0.0) >= self.prefill_delay_s

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.scored)

    def schedule(self) -> SchedulerOutput:
        # Prefill waiting prompts, oldest first, up to `prefill_chunk` tokens in all and while the
        # batch has room; decoding goes on in the same step, so prompts never stall the streams.
        # Many short prompts share one step; a long one takes the rest of the budget, in chunks.
        out = SchedulerOutput(decode=list(self.running))
        budget = self.prefill_chunk if self.prefill_due() else 0
        room = self.max_num_seqs - len(self.running)
        busy = [s for s in self.waiting if s.num_prefilled]  # prompts between chunks
        for seq in self.waiting:
            # A prompt with n choices joins as n rows; too many for any room, it goes alone.
            rows = len(seq.group)
            if budget <= 0 or (rows > room and (self.running or out.prefill)):
                break
            start = seq.num_prefilled
            if start == 0 and self.waits(seq, busy):
                continue
            # The budget counts computed tokens: a prompt's cached start is free. A whole
            # prompt starts at 0 (its prefill group is seeded with that start); a prompt in
            # chunks starts its first chunk past it.
            cached = self.cached(seq) if start == 0 else 0
            cost = seq.prompt_len - start - cached
            if cost <= budget:
                chunk = PrefillChunk(seq, start, seq.prompt_len)
            else:
                first = start + cached
                end = _uncut(seq, first, first + budget) if self.whole_runs else first + budget
                chunk = PrefillChunk(seq, first, end)
            out.prefill.append(chunk)
            busy += [seq] if start == 0 else []  # one between chunks is there already
            budget -= min(cost, budget)
            room -= rows
            if not chunk.is_last:
                break
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Account for a finished step: advance prefill, admit, and drop finished sequences."""
        for chunk in out.prefill:
            seq = chunk.seq
            seq.num_prefilled = chunk.end
            if chunk.is_last and seq in self.waiting:
                self.waiting.remove(seq)
                self.arrivals.pop(seq.seq_id, None)
                if seq.params.max_tokens == 0:
                    self.scored += seq.group
                for member in seq.joining():  # the forks start with their prompt's cache
                    member.num_prefilled = chunk.end
                    member.status = Status.RUNNING
                    self.running.append(member)
        self.drop_finished()

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if s.status is not Status.FINISHED]
        self.scored = [s for s in self.scored if s.status is not Status.FINISHED]
        if any(s.status is Status.FINISHED for s in self.waiting):  # a fault in prompt logits
            self.waiting = deque(
                s for s in self.waiting if any(m.status is not Status.FINISHED for m in s.group)
            )

    def requeue(self, seqs: list[Sequence]) -> None:
        """Retracted sequences (engine/lifecycle.py: a pause, new weights, a preemption) wait
        again, first in line among their priority, in their old order."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        for s in reversed(seqs):
            s.arrival = next(self._retracted)
        # Sorted whole: a retraction also sends prompts between chunks back to their start.
        left = (s for s in self.waiting if id(s) not in gone)
        self.waiting = deque(sorted([*seqs, *left], key=_order))
        now = self.clock()
        for s in seqs:
            self.arrivals[s.seq_id] = now

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or fault)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.arrivals.pop(seq.seq_id, None)
        self.running = [s for s in self.running if s is not seq]
        self.scored = [s for s in self.scored if s is not seq]


def _uncut(seq: Sequence, start: int, end: int) -> int:
    """A chunk's end from `start`, moved off the inside of a run of placeholders: back to the
    run's start, or, where the chunk would then be empty, on to its end (a run longer than the
    step's budget prefills whole, past it)."""
    for image in seq.images:
        for first, n in image.runs:
            if first < end < first + n:
                return first if first > start else min(first + n, seq.prompt_len)
    return end


def _order(seq: Sequence) -> tuple[int, int, int]:
    """A waiting prompt's place: those between chunks first, then priority, then arrival."""
    return (0 if seq.num_prefilled else 1, seq.priority, seq.arrival)
