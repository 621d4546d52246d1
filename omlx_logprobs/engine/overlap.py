"""The step in flight and where it is processed: on a GPU, where the host bounds the loop, on a
second thread while the engine thread builds and queues the next step (MLX launches kernels
without the GIL); on MLX's CPU backend, which computes the step inside the launch on both
cores, after the launch on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.runner.step import LaunchedStep

W = TypeVar("W")
Process = Callable[[LaunchedStep], list[Sequence]]


class Overlap:
    def __init__(self, process: Process, aside: bool) -> None:
        self._process = process  # a step's outputs; the sequences that finished in it
        self._pool = ThreadPoolExecutor(1, "omlx-process") if aside else None
        self._aside: Future[list[Sequence]] | None = None
        self.inflight: LaunchedStep | None = None  # launched, not yet processed

    def launch(self, launch: Callable[[W], LaunchedStep | None], work: W) -> LaunchedStep | None:
        """`launch(work)`, with the step in flight processed beside it when there is a second
        thread; a failed launch waits for that processing before its error goes up."""
        if self._pool is not None and self.inflight is not None:
            self._aside = self._pool.submit(self._process, self._take())
        try:
            return launch(work)
        except Exception:
            if self._aside is not None:
                wait([self._aside])
                self._aside = None
            raise

    def finish(self) -> list[Sequence]:
        """The step in flight, processed (waited for when the second thread runs it); the
        sequences that finished in it."""
        if self._aside is not None:
            aside, self._aside = self._aside, None
            return aside.result()
        return [] if self.inflight is None else self._process(self._take())

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _take(self) -> LaunchedStep:
        step, self.inflight = self.inflight, None
        assert step is not None
        return step
