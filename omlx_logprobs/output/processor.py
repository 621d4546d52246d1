"""The one loop over step outputs: record tokens and logprob entries, release text, check stops,
and hand each request its delta."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from omlx_logprobs.engine.prompt_scoring import PromptLogprobs
from omlx_logprobs.engine.sequence import Sequence, Status
from omlx_logprobs.engine.step import StepResult
from omlx_logprobs.output.detokenizer import Vocabulary
from omlx_logprobs.output.sections import TextDelta
from omlx_logprobs.types import FinishReason, RequestOutput

Sink = Callable[[Sequence, RequestOutput], None]
log = logging.getLogger("omlx_logprobs")


class OutputProcessor:
    def __init__(self, vocab: Vocabulary, eos_token_ids: tuple[int, ...], sink: Sink) -> None:
        self.vocab = vocab
        self.eos = frozenset(eos_token_ids)
        self.sink = sink

    def process(self, result: StepResult) -> list[Sequence]:
        """Apply one step; return the sequences that finished in it."""
        finished: list[Sequence] = []
        for chunk in result.prompt:
            finished += self._record_prompt(chunk)
        for seq in result.prompt_only:  # max_tokens 0: the prompt was all there was to do
            if seq.status is not Status.FINISHED:
                seq.finish(FinishReason.LENGTH)
                self.emit(seq, TextDelta(), 0)
            finished.append(seq)
        lp = result.logprobs
        # Whole-batch conversions once: per-row numpy indexing costs more than the row's work.
        tokens = result.token_ids.tolist()
        finite = result.finite.tolist() if result.finite is not None else None
        if lp is not None:
            chosen, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
            k = lp.top_ids.shape[1]
            top_ids, top_lps = lp.top_ids.tobytes(), lp.top_logprobs.tobytes()
        for i, seq in enumerate(result.seqs):
            if seq.status is Status.FINISHED:
                continue  # finished (or aborted) while this step ran: its row is surplus
            try:
                if finite is not None and not finite[i]:
                    self.fail(seq, "the model produced non-finite logits")
                else:
                    token = tokens[i]
                    seq.output_ids.append(token)
                    if seq.store is not None and lp is not None:
                        a, b = 4 * k * i, 4 * (k * i + seq.store.k)  # 4-byte items, row i's k
                        seq.store.append(token, chosen[i], ranks[i], top_ids[a:b], top_lps[a:b])
                    self._advance(seq, token)
            except Exception as exc:  # one request's fault ends that request, not its batch
                log.exception("output processing failed for %s", seq.request_id)
                self.fail(seq, f"internal error while processing this request: {exc}")
            if seq.status is Status.FINISHED:
                finished.append(seq)
        return finished

    def fail(self, seq: Sequence, message: str) -> None:
        """End a request with an error; nothing more of its output is released."""
        seq.finish(FinishReason.ERROR, message)
        self.emit(seq, TextDelta(), seq.released_tokens)

    def _record_prompt(self, chunk: PromptLogprobs) -> list[Sequence]:
        """Append a chunk's prompt entries; a NaN ends every choice of the prompt."""
        seq, lp = chunk.seq, chunk.logprobs
        assert seq.prompt_store is not None and len(seq.prompt_store) == chunk.first - 1
        seq.prompt_store.extend(chunk.token_ids, lp.logprobs, lp.ranks, lp.top_ids, lp.top_logprobs)
        if not np.isnan(lp.logprobs).any():
            return []
        ended = [s for s in seq.group if s.status is not Status.FINISHED]
        for s in ended:
            s.finish(FinishReason.ERROR, "the model produced non-finite logits")
            self.emit(s, TextDelta(), 0)
        return ended

    def _advance(self, seq: Sequence, token: int) -> None:
        data = self.vocab.token_bytes[token] if token < len(self.vocab) else None
        before = seq.token_ends[-1] if seq.token_ends else 0
        seq.token_ends.append(before + len(data or b""))
        if data:
            seq.text.feed(data)
        if seq.status is not Status.FINISHED:
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish(reason)
        if seq.status is Status.FINISHED:
            # At the end every entry goes out (stop token included) with all the text left.
            self.emit(seq, seq.text.flush(), seq.num_output)
        else:
            end, delta = seq.text.release(seq.token_ends, seq.released_tokens)
            self.emit(seq, delta, end)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if seq.text.stopped:
            return FinishReason.STOP
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def emit(self, seq: Sequence, delta: TextDelta, end: int) -> None:
        """Send the sequence's delta: its text and the entries up to `end` not sent before."""
        done = seq.status is Status.FINISHED
        if not delta and end == seq.released_tokens and not done:
            return
        out = RequestOutput(
            request_id=seq.request_id,
            text=delta.content,
            first_token=seq.released_tokens,
            end_token=end,
            finished=done,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached_tokens,
            completion_tokens=seq.num_output,
            error=seq.error,
            reasoning_text=delta.reasoning,
            content_start=seq.text.reasoning_tokens(seq.token_ends),
        )
        seq.released_tokens = end
        self.sink(seq, out)
