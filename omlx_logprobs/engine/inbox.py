"""The engine's inbox: the command records of engine/commands.py, posted from any thread (a
signal handler too) and read by the engine's thread between two steps. Shutdown's two commands
take effect at once (`stopped`, `closing_at`); the rest wait in order, each beside the future its
answer goes to."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from omlx_logprobs.control import WeightVersion
from omlx_logprobs.engine.commands import BeginShutdown, Command, Stop, posted

A = TypeVar("A")
Posted = tuple[Command[Any], Future[Any]]  # a command in the inbox, and its answer's future


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Posted] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.closing_at: float | None = None  # after this monotonic time, fail what is left

    def post(self, command: Command[A]) -> Future[A]:
        """Any thread (a signal handler too): ask the engine to do something (the records of
        engine/commands.py). Shutdown's take effect at once, the rest between two steps, in the
        order posted; the future is answered once done (a pause that waits for its requests
        once they have finished; new weights once the requests in flight allow)."""
        done: Future[A] = Future() if command.answered else posted()
        match command:
            case Stop():
                self._stop.set()
            case BeginShutdown(grace_s=grace_s):
                self.closing_at = time.monotonic() + grace_s
            case _:
                self._queue.put((command, done))
        self._wake.set()
        return done

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wait(self, timeout: float) -> None:
        """The engine's thread, idle: until something is posted, or `timeout` seconds."""
        self._wake.wait(timeout)
        self._wake.clear()

    def take(self) -> Iterator[Posted]:
        """The commands posted so far, in order, each beside its future."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def refuse(self, why: str, weights: WeightVersion) -> None:
        """The loop has ended: what is still asked of the engine is answered with why not
        (`weights`: the version the engine served)."""
        for command, done in self.take():
            if command.answered:
                done.set_result(command.refused(why, weights))
