"""Each model's requests as the API sees them (its engine client's `Observer`): time to first
token, between outputs and to the end, measured when outputs reach the server's collectors;
finish reasons and token counts once each choice ends. The outputs come on the transport's
thread; per output the work is a dict lookup and at most one histogram observation."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from omlx_logprobs.api.metrics.families import Families
from omlx_logprobs.types import EngineRequest, RequestOutput


@dataclass(slots=True)
class _Timing:
    """One request in flight: when it was submitted, its first token (0.0: none yet), each
    choice's last output, and how many choices are left."""

    submitted: float
    last: list[float]
    left: int
    first: float = 0.0


class RequestObserver:
    """One model's metrics (the `model_name` label bound once)."""

    def __init__(self, families: Families, model_name: str) -> None:
        f = families
        self.families = families
        self.model_name = model_name
        self.ttft = f.ttft.labels(model_name)
        self.itl = f.itl.labels(model_name)
        self.e2e = f.e2e.labels(model_name)
        self.prompt_tokens = f.prompt_tokens.labels(model_name)
        self.generation_tokens = f.generation_tokens.labels(model_name)
        self.prefix_queries = f.prefix_queries.labels(model_name)
        self.prefix_hits = f.prefix_hits.labels(model_name)
        self._live: dict[str, _Timing] = {}
        # Submissions (event loop) and deliveries (transport thread) both change `_live`; a
        # lost request's end may come from a third thread.
        self._lock = threading.Lock()

    def submitted(self, req: EngineRequest) -> None:
        with self._lock:
            self._live[req.request_id] = _Timing(time.monotonic(), [0.0] * req.n, req.n)

    def delivered(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        with self._lock:
            for out in outputs:
                timing = self._live.get(out.request_id)
                if timing is not None:
                    self._output(timing, out, now)

    def _output(self, t: _Timing, out: RequestOutput, now: float) -> None:
        if out.num_tokens:
            if not t.first:
                t.first = now
                self.ttft.observe(now - t.submitted)
            elif t.last[out.index]:
                self.itl.observe(now - t.last[out.index])
            t.last[out.index] = now
        if not out.finished:
            return
        reason = out.finish_reason.value if out.finish_reason is not None else "stop"
        self.families.success.labels(self.model_name, reason).inc()
        self.generation_tokens.inc(out.completion_tokens)
        if out.index == 0:  # a prompt counts once however many choices it has (as `usage`)
            self.prompt_tokens.inc(out.prompt_tokens)
            self.prefix_queries.inc(out.prompt_tokens)
            self.prefix_hits.inc(out.cached_tokens)
        t.left -= 1
        if not t.left:
            self.e2e.observe(now - t.submitted)
            del self._live[out.request_id]
