"""What an in-process engine was asked and answered, seen from outside it: each submitted
request's prompt ids and each request's sampled ids, by request id (the response's id)."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future
from typing import Any

from omlx_logprobs.engine.commands import Submit
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.types import RequestOutput


class Tap:
    def __init__(self, engine: Engine) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.sampled: dict[str, list[int]] = defaultdict(list)
        post, sink = engine.post, engine.sink

        def tapped_post(command: Any) -> Future[Any]:
            if isinstance(command, Submit):
                self.prompts[command.request.request_id] = list(command.request.prompt_ids)
            return post(command)

        def tapped_sink(outputs: list[RequestOutput]) -> None:
            for out in outputs:
                if out.index == 0:
                    self.sampled[out.request_id] += out.token_ids.tolist()
            sink(outputs)

        engine.post = tapped_post  # type: ignore[method-assign]
        engine.sink = tapped_sink
