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
    """One step's work: decode every running sequence, and prefill prompt chunks within the
    step's token budget, oldest prompt first. Only the last chunk of the list may be partial."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


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
        # Prefill waiting prompts, oldest first, up to `prefill_chunk` tokens in all and while the
        # batch has room; decoding goes on in the same step, so prompts never stall the streams.
        # Many short prompts share one step; a long one takes the rest of the budget, in chunks.
        out = SchedulerOutput(decode=list(self.running))
        budget = self.prefill_chunk
        room = self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if budget <= 0 or room <= 0:
                break
            end = min(seq.prompt_len, seq.num_prefilled + budget)
            chunk = PrefillChunk(seq, seq.num_prefilled, end)
            out.prefill.append(chunk)
            budget -= end - seq.num_prefilled
            room -= 1
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
                if seq.status is Status.WAITING:
                    seq.status = Status.RUNNING
                    self.running.append(seq)
        self.drop_finished()

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if s.status is not Status.FINISHED]

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or fault)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.running = [s for s in self.running if s is not seq]
