"""What changes the engine's state between two steps besides requests (docs/specs/rl.md): pause
(each mode), resume and flush; sleep (its memory released) and wake; new weights, once the
requests in flight allow; LoRA adapters loaded, replaced and unloaded; retraction, which frees
running requests' keys and values so that they prefill again (all of them for a pause or new
weights; a few lower-priority ones when a higher-priority prompt needs their rows: `preempt`).
The engine hands it its parts and two callbacks (whether work is left to run, and how requests
are aborted); it imports nothing above engine/."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from omlx_logprobs.batch.scheduler import Scheduler
from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.control import (
    AdapterChange,
    Control,
    ControlResult,
    PauseMode,
    WeightUpdate,
    WeightUpdateResult,
    WeightVersion,
)
from omlx_logprobs.engine.processor import OutputProcessor
from omlx_logprobs.runner.lora import AdapterError
from omlx_logprobs.runner.model_runner import ModelRunner
from omlx_logprobs.runner.weights import WeightsError

log = logging.getLogger("omlx_logprobs")


@dataclass
class PendingUpdate:
    """New weights, once the requests in flight have finished (or been aborted)."""

    update: WeightUpdate
    done: Future[WeightUpdateResult]
    asked: float  # monotonic time of the request
    aborted: int = 0  # requests it aborted


@dataclass(frozen=True)
class PendingPause:
    """A pause not yet answered: a wait pause until nothing runs, a halting one until the step
    in flight is processed."""

    mode: PauseMode
    aborted: int  # requests it ended (an abort pause)
    done: Future[ControlResult]


@dataclass(frozen=True)
class PendingSleep:
    """A sleep not yet answered: its requests were aborted; it takes effect once nothing runs."""

    level: int
    aborted: int
    done: Future[ControlResult]


class Lifecycle:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        processor: OutputProcessor,
        live: dict[str, list[Sequence]],
        has_work: Callable[[], bool],
        abort: Callable[[list[Sequence]], None],
    ) -> None:
        """`live`: the engine's unfinished requests' choices by request id (read here, never
        written); `abort`: ends these choices with finish reason abort, their rows freed."""
        self.scheduler, self.runner, self.processor = scheduler, runner, processor
        self._live = live
        self._has_work = has_work
        self._abort = abort
        # Weight updates asked for, oldest first, and the requests that arrived after one was
        # (or while paused): they start on the new weights (runner/weights.py).
        self.updates: list[PendingUpdate] = []
        self.held: list[Sequence] = []
        self.paused: PauseMode | None = None
        self._pausing: list[PendingPause] = []
        # The sleep level while asleep (0: awake), and the sleeps asked for, not yet in effect.
        self.sleeping = 0
        self._sleeps: list[PendingSleep] = []

    @property
    def halted(self) -> bool:
        """Paused in place (keep, retract): no step runs."""
        return self.paused is not None and self.paused.halts

    def holds(self, leader: Sequence) -> bool:
        """Whether a new request waits (held here): while new weights are to come or the engine
        is paused, it starts on the weights asked for."""
        if not self.updates and not self.paused and not self.sleeping:
            return False
        self.held.append(leader)
        return True

    def adapt(self, leader: Sequence, name: str | None) -> bool:
        """Put each choice of a new request on its LoRA adapter; an adapter unloaded since the
        API routed the request ends it with an error."""
        if name is None:
            return True
        slot = self.runner.adapters.slot_of(name)
        for s in leader.group:
            if slot is None:
                self.processor.fail(s, f"the LoRA adapter {name!r} is not loaded (unloaded)")
            else:
                s.adapter, s.adapter_version = slot, self.runner.adapters.version(slot)
        return slot is not None

    # ---- commands, read from the engine's inbox -----------------------------------------------
    def update_weights(self, update: WeightUpdate, done: Future[WeightUpdateResult]) -> None:
        pending = PendingUpdate(update, done, time.monotonic())
        self.updates.append(pending)
        if update.abort_in_flight:
            pending.aborted = self._abort_in_flight()

    def change_adapter(self, change: AdapterChange, done: Future[str | None]) -> None:
        try:
            self.runner.change_adapter(change)
        except AdapterError as exc:
            done.set_result(str(exc))
            return
        except Exception as exc:  # an unexpected failure: the adapter is not served, the rest is
            log.exception("changing the adapter %s failed", change.name)
            done.set_result(f"the adapter could not be loaded: {exc}")
            return
        what = "unloaded" if change.path is None else f"loaded from {change.path}"
        log.info("LoRA adapter %s %s", change.name, what)
        done.set_result(None)

    def control(self, command: Control, done: Future[ControlResult]) -> None:
        if command.action == "flush":
            self.runner.flush_prefixes()
            done.set_result(ControlResult(self.paused is not None))
        elif command.action == "resume":
            self.paused = None
            for pause in self._pausing:  # a pause not yet answered is overtaken
                pause.done.set_result(ControlResult(False, error="resumed before it took effect"))
            self._pausing = []
            if not self.updates and not self.sleeping:
                self._release_held()
            done.set_result(ControlResult(False))
        elif command.action == "sleep":
            # vLLM's sleep needs an idle engine: the requests in flight end (finish reason
            # abort), new ones wait (the API answers 503 meanwhile: api/rl/sleep.py).
            aborted = self._abort_in_flight()
            self.sleeping = max(self.sleeping, command.level)
            self._sleeps.append(PendingSleep(command.level, aborted, done))
        elif command.action == "wake":
            self._wake(command.path, done)
        else:
            mode = command.mode
            aborted = self._abort_in_flight() if mode is PauseMode.ABORT else 0
            if self.paused is None or mode.halts or self.paused is PauseMode.WAIT:
                self.paused = mode  # a later pause may only halt more
            self._pausing.append(PendingPause(mode, aborted, done))

    # ---- between two steps --------------------------------------------------------------------
    def settle(self) -> None:
        """After the inbox is read (and a halted engine's step in flight processed): adapters
        no request uses any more released, the pauses that took effect answered, and the new
        weights loaded once nothing runs."""
        if self.runner.adapters.retiring:
            self._release_adapters()
        if self._pausing:
            self._answer_pauses()
        if self._sleeps and not self._has_work():
            self._sleep()
        if self.updates and (not self._has_work() or self.halted):
            self._swap_weights()

    def close(self, why: str) -> None:
        """The engine stops: what is still asked of it is answered with why not."""
        for pending in self.updates:
            pending.done.set_result(WeightUpdateResult(self.processor.weights, why))
        for pause in self._pausing:
            pause.done.set_result(ControlResult(False, error=why))
        for sleep in self._sleeps:
            sleep.done.set_result(ControlResult(False, error=why))
        self.updates, self._pausing, self._sleeps = [], [], []

    def _release_adapters(self) -> None:
        in_use = {
            s.adapter
            for members in self._live.values()
            for s in members
            if s.status is not Status.FINISHED
        }
        self.runner.release_adapters(in_use)

    def _abort_in_flight(self) -> int:
        """End every request that arrived before the update or pause (its finish reason:
        abort); how many."""
        held = {id(s) for s in self.held}
        ended = [members for members in self._live.values() if id(members[0]) not in held]
        self._abort([s for members in ended for s in members])
        return len(ended)

    def _swap_weights(self) -> None:
        """Nothing runs: load the asked weights in order (a failed one leaves the weights before
        it), answer each, then start the requests that waited for them."""
        if self._has_work():  # paused in place: the old weights' keys and values go
            self.retract()
        # retracted (now or by the pause): their tokens from here on are the new weights'
        kept = [s for s in self.scheduler.waiting if s.num_output]
        first = self.processor.weights
        for pending in self.updates:
            self._load(pending)
        self.updates = []
        now = self.processor.weights
        for s in kept:
            if s.num_output and (not s.weight_spans or s.weight_spans[-1][1] != now):
                s.weight_spans = s.weight_spans or [(0, first)]
                s.weight_spans.append((s.num_output, now))
        if self.paused is None and not self.sleeping:
            self._release_held()

    def _sleep(self) -> None:
        """Nothing runs: the memory of the deepest sleep asked goes (runner's `sleep`), and
        each sleep is answered."""
        try:
            self.runner.sleep(max(s.level for s in self._sleeps))
        except Exception as exc:  # asleep only if the weights went (perhaps half): else awake
            log.exception("sleeping failed")
            for pending in self._sleeps:
                pending.done.set_result(ControlResult(False, error=f"sleeping failed: {exc}"))
            if self.runner.dropped is None:
                self.sleeping = 0
                if not self.updates and self.paused is None:
                    self._release_held()
        else:
            for pending in self._sleeps:
                pending.done.set_result(ControlResult(True, aborted=pending.aborted))
        self._sleeps = []

    def _wake(self, path: str | None, done: Future[ControlResult]) -> None:
        """Weights dropped by a level-2 sleep read again from `path`, then the requests that
        waited start; a failed read leaves the engine asleep."""
        if self._sleeps:  # asked to sleep but not yet asleep: nothing was released
            for pending in self._sleeps:
                pending.done.set_result(ControlResult(False, error="woken before it took effect"))
            self._sleeps = []
        try:
            self.runner.wake(path)
        except Exception as exc:  # WeightsError or worse: the weights stay dropped
            log.warning("waking failed: the weights from %s not loaded: %s", path, exc)
            done.set_result(ControlResult(False, error=f"waking failed: {exc}"))
            return
        self.sleeping = 0
        if not self.updates and self.paused is None:
            self._release_held()
        done.set_result(ControlResult(False))

    def _load(self, pending: PendingUpdate) -> None:
        """One update's weights in place, and its answer."""
        update, done, before = pending.update, pending.done, self.processor.weights
        try:
            self.runner.load_weights(update.path)
        except WeightsError as exc:
            log.warning("weights from %s not loaded: %s", update.path, exc)
            done.set_result(WeightUpdateResult(before, str(exc)))
            return
        except Exception as exc:  # the model may be half written: say so, keep serving
            log.exception("loading weights from %s failed", update.path)
            done.set_result(WeightUpdateResult(before, f"loading the weights failed: {exc}"))
            return
        now = WeightVersion(before.counter + 1, update.tag)
        self.processor.weights = now
        took = time.monotonic() - pending.asked
        log.info("weights version %d from %s in %.2f s", now.counter, update.path, took)
        done.set_result(WeightUpdateResult(now, None, pending.aborted, took))

    def _answer_pauses(self) -> None:
        """Answer the pauses that took effect: halting ones once the step in flight was
        processed (retract then frees the requests' keys and values), a wait pause once
        nothing runs, an abort pause at once."""
        left: list[PendingPause] = []
        for pause in self._pausing:
            mode = pause.mode
            if mode is PauseMode.WAIT and self._has_work():
                left.append(pause)
                continue
            held = len(self.scheduler.running) + len(self.scheduler.waiting)
            if mode is PauseMode.RETRACT:
                held = len(self.retract())
            pause.done.set_result(
                ControlResult(True, aborted=pause.aborted, held=held if mode.halts else 0)
            )
        self._pausing = left

    def retract(self) -> list[Sequence]:
        """Stop every request where it is and free its keys and values: prompts half
        prefilled start again, running choices wait to be prefilled again from their prompt
        and output (each on its own); the running ones, retracted."""
        running = list(self.scheduler.running)
        for s in self.scheduler.waiting:
            if s.num_prefilled:
                self.runner.release([s])
                s.num_prefilled = 0
        self.preempt(running)
        return running

    def preempt(self, seqs: list[Sequence]) -> None:
        """Retract these running choices, with no step in flight: their rows freed (their keys
        and values kept as prefixes: the same weights), each waits to be prefilled again from
        its prompt and output (vLLM's preemption by recompute)."""
        self.runner.release(seqs)
        for s in seqs:
            self.scheduler.arrivals.pop(s.seq_id, None)
            s.retract()
        self.scheduler.requeue(seqs)

    def _release_held(self) -> None:
        """Requests that waited for new weights or a resume start (those aborted meanwhile
        are gone)."""
        for leader in self.held:
            if any(s.status is not Status.FINISHED for s in leader.group):
                self.scheduler.add(leader)
        self.held = []
