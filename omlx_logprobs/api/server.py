"""uvicorn with this server's shutdown policy.

On the first SIGINT or SIGTERM uvicorn stops accepting connections and waits for open ones; the
engine gives in-flight requests `shutdown_grace_s` to finish, then ends the rest with an error
(a stream gets an error event, a plain request an error body), so every client is answered before
the process exits. A second SIGINT exits at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from omlx_logprobs.config import ServerConfig

log = logging.getLogger("omlx_logprobs")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_first_signal = on_first_signal
        self.signals: list[int] = []

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        if not self.should_exit:
            self._on_first_signal()
        super().handle_exit(sig, frame)


def run_server(
    app: FastAPI, begin_shutdown: Callable[[float], None], cfg: ServerConfig, log_level: str
) -> list[int]:
    """Serve until a signal's graceful shutdown is done; the signals received, in order."""
    grace = cfg.shutdown_grace_s
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        # A backstop only: the engine has ended every request by `grace`, streams close after.
        timeout_graceful_shutdown=int(grace) + 5,
    )
    server = _Server(config, lambda: begin_shutdown(grace))
    server.run()
    return server.signals
