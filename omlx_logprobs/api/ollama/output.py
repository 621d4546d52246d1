"""Ollama's response objects: one NDJSON chunk per output while streaming (the text, thinking and
whole tool calls it carries, and `logprobs`: the entries of exactly its tokens), a last chunk
with `done`, `done_reason` and the counts; not streamed, one object with all of them.

Ollama returns one `logprobs` list for a chunk's tokens whatever their section; so does this
server: reasoning, content and tool-call tokens in order, each once."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from omlx_logprobs.api.core.prepare import Prepared
from omlx_logprobs.api.core.sections import dumps
from omlx_logprobs.types import FinishReason, RequestOutput, ToolCall


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _json(obj: Any) -> str:
    return dumps(obj)


class OllamaOutput:
    """Chunks for `/api/chat` (`chat`: a `message`) or `/api/generate` (a `response`)."""

    def __init__(self, p: Prepared, chat: bool, model: str) -> None:
        self.p, self.chat, self.model = p, chat, model
        self.logprobs = p.first.params.logprobs
        self.started = time.monotonic_ns()
        self.first_at: int | None = None
        self.calls = 0

    def chunk(self, out: RequestOutput, done: bool = False) -> str:
        """One output's chunk (not streamed: the merged output, with the counts)."""
        if self.first_at is None:
            self.first_at = time.monotonic_ns()
        body: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            if out.reasoning_text:
                message["thinking"] = out.reasoning_text
            if out.tool_calls:
                message["tool_calls"] = [self._call(c) for c in out.tool_calls]
            body["message"] = message
        else:
            body["response"] = out.text
            if out.reasoning_text:
                body["thinking"] = out.reasoning_text
        body["done"] = done
        if done:
            body.update(self.counts(out))
        text = _json(body)
        if self.logprobs and out.logprobs is not None:
            text = text[:-1] + f',"logprobs":{self.p.writer.entries(out.logprobs)}}}'
        return text

    def last(self, out: RequestOutput) -> str:
        """The streamed chunk that ends the answer: no text, `done`, the counts."""
        end = RequestOutput(out.request_id, finish_reason=out.finish_reason,
                            prompt_tokens=out.prompt_tokens,
                            completion_tokens=out.completion_tokens)  # fmt: skip
        return self.chunk(end, done=True)

    def _call(self, c: ToolCall) -> dict[str, Any]:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = c.arguments
        fn = {"index": self.calls, "name": c.name, "arguments": args}
        self.calls += 1
        return {"function": fn}

    def counts(self, out: RequestOutput) -> dict[str, Any]:
        """`done_reason` and Ollama's counts and durations (ns): the prompt's time is until the
        first output, the output's after it."""
        end = time.monotonic_ns()
        first = self.first_at or end
        reason = "length" if out.finish_reason is FinishReason.LENGTH else "stop"
        return {
            "done_reason": reason,
            "total_duration": end - self.started,
            "load_duration": 0,
            "prompt_eval_count": out.prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": out.completion_tokens,
            "eval_duration": end - first,
        }
