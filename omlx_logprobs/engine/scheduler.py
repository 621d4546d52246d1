"""Which requests run in the next step. Plain Python over Sequence objects: no model, no mlx."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omlx_logprobs.engine.sequence import Sequence, Status


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
    """One step's work: decode every running sequence, and prefill at most one prompt chunk."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: PrefillChunk | None = None

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, max_num_seqs: int, prefill_chunk: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        # Prefill the oldest waiting prompt by one chunk while the batch has room; decoding the
        # running batch continues in the same step, so a long prompt never stalls other streams.
        out = SchedulerOutput(decode=list(self.running))
        if self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            end = min(seq.prompt_len, seq.num_prefilled + self.prefill_chunk)
            out.prefill = PrefillChunk(seq, seq.num_prefilled, end)
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Account for a finished step: advance prefill, admit, and drop finished sequences."""
        if out.prefill is not None:
            seq = out.prefill.seq
            seq.num_prefilled = out.prefill.end
            if out.prefill.is_last and self.waiting and self.waiting[0] is seq:
                self.waiting.popleft()
                if seq.status is Status.WAITING:
                    seq.status = Status.RUNNING
                    self.running.append(seq)
        self.running = [s for s in self.running if s.status is not Status.FINISHED]

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or fault)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.running = [s for s in self.running if s is not seq]
