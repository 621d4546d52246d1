"""The one loop over step outputs: record tokens and logprob entries, release text, check stops,
and make each request's `RequestOutput`."""

from __future__ import annotations

import logging

import numpy as np

from omlx_logprobs.batch.budget import forced_token, note_reasoning_start
from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.control import INITIAL_WEIGHTS
from omlx_logprobs.output.sections import NO_TEXT, TextDelta
from omlx_logprobs.runner.grammar import leaves
from omlx_logprobs.runner.prompt_scoring import PromptSlice
from omlx_logprobs.runner.routing import assemble
from omlx_logprobs.runner.step import StepResult
from omlx_logprobs.types import Entries, FinishReason, RequestOutput, SamplingParams
from omlx_logprobs.vocab import Vocabulary

log = logging.getLogger("omlx_logprobs")


class OutputProcessor:
    def __init__(self, vocab: Vocabulary, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab = vocab
        self.eos = frozenset(eos_token_ids)
        self._outputs: list[RequestOutput] = []  # made since the last `take`
        self.weights = INITIAL_WEIGHTS  # the engine's; changes only while nothing runs

    def take(self) -> list[RequestOutput]:
        """The outputs made since the last call, in order."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def process(self, result: StepResult) -> list[Sequence]:
        """Apply one step; return the sequences that finished in it."""
        finished: list[Sequence] = []
        for rows, entries in result.prompt:
            finished += self._record_prompt(rows, entries)
        for seq, hidden in result.pooled:  # an embedding request's output, sent as it ends
            if np.isfinite(hidden).all():
                seq.embedding = hidden
            elif seq.status is not Status.FINISHED:
                self.fail(seq, "the model produced non-finite hidden states")
        for seq in result.prompt_only:  # max_tokens 0: the prompt was all there was to do
            if seq.status is not Status.FINISHED:
                seq.finish(FinishReason.LENGTH)
                self.emit(seq, NO_TEXT, 0)
            finished.append(seq)
        lp = result.logprobs
        # Whole-batch conversions once: per-row numpy indexing costs more than the row's work.
        tokens = result.token_ids.tolist()
        finite = result.finite.tolist()
        if lp is not None:
            chosen, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
            k = lp.k
            top_ids, top_lps = lp.top_ids.tobytes(), lp.top_logprobs.tobytes()
            tails = lp.tail.tolist() if lp.tail is not None else None
        predicted = result.predicted.tolist() if result.predicted is not None else None
        for i, seq in enumerate(result.seqs):
            if seq.status is Status.FINISHED:
                continue  # finished (or aborted) while this step ran: its row is surplus
            try:
                if not finite[i]:
                    self.fail(seq, "the model produced non-finite logits")
                else:
                    token = tokens[i]
                    # read before the token moves the parser on: a thinking budget's close
                    forced = forced_token(seq, seq.num_output) is not None
                    seq.output_ids.append(token)
                    if predicted is not None and predicted[i]:  # not past a stop: in the output
                        seq.accepted_prediction_tokens += 1
                    if seq.store is not None and lp is not None:
                        a, b = 4 * k * i, 4 * (k * i + seq.store.k)  # 4-byte items, row i's k
                        tail = tails[i] if tails is not None else None
                        seq.store.append(
                            token, chosen[i], ranks[i], top_ids[a:b], top_lps[a:b], tail
                        )
                        if forced:
                            seq.store.mark_forced()
                    self._advance(seq, token)
                    note_reasoning_start(seq)
            except Exception as exc:  # one request's fault ends that request, not its batch
                log.exception("output processing failed for %s", seq.request_id)
                self.fail(seq, f"internal error while processing this request: {exc}")
            if seq.status is Status.FINISHED:
                finished.append(seq)
        return finished

    def fail(self, seq: Sequence, message: str) -> None:
        """End a request with an error; nothing more of its output is released."""
        seq.finish(FinishReason.ERROR, message)
        self.emit(seq, NO_TEXT, seq.released_tokens)

    def end(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        """End a request from outside a step (abort, shutdown): all its text goes out."""
        seq.finish(reason, error)
        self.emit(seq, seq.text.flush(), seq.num_output)

    def _record_prompt(self, rows: PromptSlice, entries: Entries) -> list[Sequence]:
        """Append a chunk's prompt entries; a NaN ends every choice of the prompt."""
        seq = rows.seq
        assert seq.prompt_store is not None and len(seq.prompt_store) == rows.first - 1
        seq.prompt_store.extend(entries)
        if not np.isnan(entries.logprobs).any():
            return []
        ended = [s for s in seq.group if s.status is not Status.FINISHED]
        for s in ended:
            s.finish(FinishReason.ERROR, "the model produced non-finite logits")
            self.emit(s, NO_TEXT, 0)
        return ended

    def _advance(self, seq: Sequence, token: int) -> None:
        p = seq.params
        done = False  # the grammar is complete and EOS was sampled (the only token it allowed)
        left = False  # an open-ended grammar is complete and the token does not continue it
        if (g := seq.grammar) is not None:
            if leaves(g, p.constraint, token):
                left = True
            elif not g.consume_token(token):  # the mask allowed it: a bug if this happens
                raise RuntimeError(f"token {token} is outside the grammar: {g.get_error()}")
            done = g.is_stopped() and (token in self.eos or not self.eos)
        data = self.vocab.token_bytes[token] if token < len(self.vocab) else None
        if data is None and not p.skip_special_tokens and token < len(self.vocab):
            data = self.vocab.token_text[token].encode()  # a special token's literal text
        stops = self._stop_token(p, token) or (done and token in self.eos)
        if left:
            data, done = None, True  # the output ends before the token: it adds no text
        elif stops and not p.include_stop_str_in_output:
            data = None  # as vLLM: the token that stops a request adds no text unless asked
        before = seq.token_ends[-1] if seq.token_ends else 0
        seq.token_ends.append(before + len(data or b""))
        if p.min_tokens:  # vLLM: no stop string before the output has more than min_tokens
            seq.text.arm_stops(seq.num_output > p.min_tokens)
        if data:
            seq.text.feed(data)
        if seq.status is not Status.FINISHED:
            reason = FinishReason.STOP if done or stops else self._finish_reason(seq)
            if reason is not None:
                seq.finish(reason)
        if seq.status is Status.FINISHED:
            # At the end every entry goes out (stop token included) with all the text left.
            self.emit(seq, seq.text.flush(), seq.num_output)
        elif seq.stream:  # a request that is not streamed gets its text at the end
            end, delta = seq.text.release(seq.token_ends, seq.released_tokens)
            self.emit(seq, delta, end)

    def _stop_token(self, p: SamplingParams, token: int) -> bool:
        return (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        """Beyond a stopping token (looked at once, in `_advance`): a stop string, the length."""
        p = seq.params
        if seq.text.stopped:
            return FinishReason.STOP
        if seq.num_output >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def emit(self, seq: Sequence, delta: TextDelta, end: int) -> None:
        """The sequence's output: its text and the tokens up to `end` not sent before."""
        done = seq.status is Status.FINISHED
        first = seq.released_tokens
        if not done and not delta and end == first:
            return
        reasoning = seq.text.reasoning_tokens(seq.token_ends)
        tool_start = seq.text.tool_start(seq.token_ends)
        tool_start = seq.num_output if tool_start is None else tool_start
        prompt = None
        if seq.prompt_store is not None and not seq.prompt_released:
            prompt = seq.prompt_store.block(0, len(seq.prompt_store))
            seq.prompt_released = True
        out = RequestOutput(
            request_id=seq.request_id,
            index=seq.choice_index,
            token_ids=np.frombuffer(seq.output_ids[first:end], np.int32),
            text=delta.content,
            reasoning_text=delta.reasoning,
            num_reasoning=min(max(reasoning - first, 0), end - first),
            tool_calls=delta.calls,
            num_tool=max(end - max(first, tool_start), 0),
            logprobs=seq.store.block(first, end) if seq.store is not None else None,
            prompt_logprobs=prompt,
            finished=done,
            finish_reason=seq.finish_reason,
            error=seq.error,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.num_output,
            cached_tokens=seq.cached_tokens,
            reasoning_tokens=reasoning,
            tool_tokens=seq.num_output - tool_start,
            accepted_prediction_tokens=seq.accepted_prediction_tokens,
            rejected_prediction_tokens=seq.rejected_prediction_tokens,
            weight_version=seq.weight_spans[0][1] if seq.weight_spans else self.weights,
            weight_spans=tuple(seq.weight_spans),
            adapter=seq.adapter_version,
            routed_experts=self._routed_experts(seq) if done else None,
            embedding=seq.embedding if done else None,
        )
        seq.released_tokens = end
        self._outputs.append(out)

    @staticmethod
    def _routed_experts(seq: Sequence) -> np.ndarray | None:
        """A finished choice's routed experts when asked: every position the model computed,
        the prompt's and each output token's but the last (which no forward took in)."""
        if not seq.params.return_routed_experts:
            return None
        return assemble(seq.routes, len(seq.prompt_ids) + max(seq.num_output - 1, 0))
