"""The engine's /health snapshot, and step-loop counters logged every few seconds like vLLM's
periodic stats line: enough to tell a starved engine (host time near wall time) from a
device-bound one."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field, replace

from omlx_logprobs.control import INITIAL_WEIGHTS, WeightVersion
from omlx_logprobs.runner.step import DeviceTime, Tallies

log = logging.getLogger("omlx_logprobs")
# Diagnostics (OMLX_STEP_TRACE=1): a log line per step, "step-trace: END LAUNCH_MS COMPLETE_MS
# ROWS PROMPT_TOKENS QUEUE_MS ASIDE_MS ASIDE_LAG_MS" (END on the monotonic clock), to line steps
# up with a load generator's request times (bench/waves.py). ASIDE: the last step's processing
# on the second thread (GPU); its LAG, how long it ran past the launch's last async_eval (the
# launching thread then waits for the GIL).
TRACE = os.environ.get("OMLX_STEP_TRACE", "") not in ("", "0")
GC_TRACE_MS = 1.0  # with the trace on, Python's collections at least this long are logged too


_gc_started = [0.0]  # when the collection in progress began


def _gc_timer(phase: str, info: dict[str, int]) -> None:
    """gc.callbacks hook: "gc-trace: END GENERATION MS COLLECTED" on the step trace's clock."""
    now = time.perf_counter()
    if phase == "start":
        _gc_started[0] = now
    elif (ms := 1e3 * (now - _gc_started[0])) >= GC_TRACE_MS:
        log.info("gc-trace: %.6f %d %.3f %d", now, info["generation"], ms, info["collected"])


if TRACE:
    gc.callbacks.append(_gc_timer)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health: what is queued, what holds KV memory, and how much MLX holds."""

    waiting: int
    running: int
    cached_sequences: int  # batch cache rows plus prompts mid-prefill
    step_in_flight: bool  # a launched step not yet processed (it holds its small arrays)
    active_memory: int  # bytes in live MLX arrays, weights included
    cache_memory: int  # bytes MLX keeps from freed arrays for reuse
    aborted_waiting: int  # requests aborted (client gone) before their prompt was prefilled
    aborted_running: int  # ... and while decoding
    # bytes of the prefix cache's kept sequences (in active_memory; bounded by its budget)
    prefix_cache_bytes: int = 0
    weights: WeightVersion = INITIAL_WEIGHTS  # the weights serving now
    updating: bool = False  # a weight update waits for the requests in flight
    paused: str | None = None  # the pause mode while paused (docs/specs/rl.md)
    sleeping: int = 0  # the sleep level while asleep, else 0 (docs/specs/rl.md)
    distributed: GroupHealth | None = None  # the processes the model is split over, if any
    tallies: Tallies = Tallies()  # disk-tier hits, speculation's drafts (since the engine began)


@dataclass(frozen=True)
class RankHealth:
    """One process of a distributed group (distributed/distributed.py), as rank 0 knows it."""

    rank: int
    host: str
    holds: str  # its share of the model
    weight_mib: float
    state: str  # "ok", or "lost" once the group is


@dataclass(frozen=True)
class GroupHealth:
    world_size: int
    backend: str
    mode: str  # "tensor" or "pipeline"
    state: str  # "ok", or "lost": the group cannot run a step any more
    fault: str | None
    ranks: tuple[RankHealth, ...]

    def lost(self, why: str) -> GroupHealth:
        """The same group once it cannot run a step: rank 0 (the server) stays."""
        ranks = tuple(replace(r, state="lost") if r.rank else r for r in self.ranks)
        return replace(self, state="lost", fault=self.fault or why, ranks=ranks)


@dataclass
class StepStats:
    interval_s: float = float(os.environ.get("OMLX_STATS_INTERVAL_S", "10"))
    steps: int = 0
    rows: int = 0  # sequences sampled, over all steps
    prefill_tokens: int = 0
    cached_tokens: int = 0  # of prefill_tokens: taken from the prefix cache
    launch_s: float = 0.0  # host time building and queueing steps
    # Processing the last step's outputs (on a GPU: waiting for the thread that did), admitting
    # and freeing rows.
    complete_s: float = 0.0
    queue_s: float = 0.0  # of launch_s: in async_eval (on a GPU the host launches kernels there)
    # Reading steps back, the wait for the device included (part of complete_s on the CPU; on
    # a GPU the second thread reads, beside the launch).
    read_s: float = 0.0
    flush_s: float = 0.0  # handing outputs over (to collectors, or to the server's process)
    # Decode-only steps (rows sampled, no prompt tokens): the host time a decoding batch costs
    # per step, apart from steps that also prefill (bench/run.py reads these from the log).
    decode_steps: int = 0
    decode_rows: int = 0
    decode_launch_s: float = 0.0
    aside: tuple[float, float] = (0.0, 0.0)  # the last processing on the second thread: start, end
    _since: float = field(default_factory=time.perf_counter)

    def add(
        self,
        rows: int,
        prefill_tokens: int,
        cached_tokens: int,
        launch_s: float,
        complete_s: float,
        device: DeviceTime,
    ) -> None:
        self.steps += 1
        self.rows += rows
        self.prefill_tokens += prefill_tokens
        self.cached_tokens += cached_tokens
        self.launch_s += launch_s
        self.complete_s += complete_s
        self.queue_s += device.queue_s
        self.read_s += device.read_s
        if rows and not prefill_tokens:
            self.decode_steps += 1
            self.decode_rows += rows
            self.decode_launch_s += launch_s
        end = time.perf_counter()
        if TRACE:
            a0, a1 = self.aside
            lag = a1 - device.queued_at if a1 and device.queued_at else 0.0
            log.info(
                "step-trace: %.6f %.3f %.3f %d %d %.3f %.3f %.3f",
                end, 1e3 * launch_s, 1e3 * complete_s, rows, prefill_tokens,
                1e3 * device.queue_s, 1e3 * (a1 - a0), 1e3 * lag,
            )  # fmt: skip
            self.aside = (0.0, 0.0)
        if end - self._since >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        wall = time.perf_counter() - self._since
        if self.steps and log.isEnabledFor(logging.INFO):
            log.info(
                "engine: %.1f steps/s, %.1f rows/step, %.0f tokens/s generated, %.0f prompt "
                "tokens/s (%.0f%% cached); per step %.2f ms launch (%.2f queueing), %.2f ms "
                "complete (%.2f reading), %.2f ms handing over; decode-only steps: %d, "
                "%.2f ms launch at %.1f rows",
                self.steps / wall,
                self.rows / self.steps,
                self.rows / wall,
                self.prefill_tokens / wall,
                100 * self.cached_tokens / max(self.prefill_tokens, 1),
                1e3 * self.launch_s / self.steps,
                1e3 * self.queue_s / self.steps,
                1e3 * self.complete_s / self.steps,
                1e3 * self.read_s / self.steps,
                1e3 * self.flush_s / self.steps,
                self.decode_steps,
                1e3 * self.decode_launch_s / max(self.decode_steps, 1),
                self.decode_rows / max(self.decode_steps, 1),
            )
        self.steps = self.rows = self.prefill_tokens = self.cached_tokens = 0
        self.decode_steps = self.decode_rows = 0
        self.decode_launch_s = 0.0
        self.launch_s = self.complete_s = self.queue_s = self.read_s = self.flush_s = 0.0
        self._since = time.perf_counter()
