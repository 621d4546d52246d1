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
    """One step's work: decode every running sequence, and prefill at most one prompt chunk
    (for a sequence with forks, the chunk is theirs too)."""

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
        # A prompt with n choices joins as n rows; it waits for room unless the batch is empty.
        if self.waiting and (
            not self.running or len(self.running) + len(self.waiting[0].group) <= self.max_num_seqs
        ):
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
                for member in seq.group:  # the forks start with their prompt's cache
                    member.num_prefilled = out.prefill.end
                    if member.status is Status.WAITING:
                        member.status = Status.RUNNING
                        self.running.append(member)
        self.running = [s for s in self.running if s.status is not Status.FINISHED]
        if self.waiting and all(s.status is Status.FINISHED for s in self.waiting[0].group):
            self.waiting.popleft()  # ended while prefilling (a fault in its prompt's logits)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or fault)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.running = [s for s in self.running if s is not seq]
