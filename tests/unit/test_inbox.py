"""The engine's inbox (engine/inbox.py): shutdown's commands take effect at once, the rest are
read in the order posted, and what is left when the loop ends is answered with why not."""

from __future__ import annotations

import time

from omlx_logprobs.control import (
    Control,
    ControlResult,
    PauseMode,
    WeightUpdate,
    WeightUpdateResult,
    WeightVersion,
)
from omlx_logprobs.engine.commands import Abort, BeginShutdown, ControlCommand, Stop, UpdateWeights
from omlx_logprobs.engine.inbox import Inbox


def test_shutdown_takes_effect_at_once_and_the_rest_waits_in_order() -> None:
    inbox = Inbox()
    pause = ControlCommand(Control("pause", PauseMode.KEEP))
    answer = inbox.post(pause)
    assert inbox.post(Abort("r1")).done() and not answer.done()
    before = time.monotonic()
    inbox.post(BeginShutdown(2.0))
    assert inbox.closing_at is not None and before + 2.0 <= inbox.closing_at <= before + 3.0
    assert not inbox.stopped
    inbox.post(Stop())
    assert inbox.stopped
    assert [command for command, _ in inbox.take()] == [pause, Abort("r1")]
    assert list(inbox.take()) == []


def test_what_is_left_is_refused_with_why() -> None:
    inbox = Inbox()
    weights = WeightVersion(3, "step-3")
    update = inbox.post(UpdateWeights(WeightUpdate("/weights/step-4")))
    pause = inbox.post(ControlCommand(Control("pause")))
    inbox.post(Abort("r1"))
    inbox.refuse("the server is shutting down", weights)
    assert update.result(0) == WeightUpdateResult(weights, "the server is shutting down")
    assert pause.result(0) == ControlResult(False, error="the server is shutting down")
    assert list(inbox.take()) == []


def test_an_idle_wait_ends_when_something_is_posted() -> None:
    inbox = Inbox()
    t0 = time.monotonic()
    inbox.wait(0.05)  # nothing posted: the whole timeout
    assert time.monotonic() - t0 >= 0.04
    inbox.post(Abort("r1"))
    t0 = time.monotonic()
    inbox.wait(5.0)  # posted already: at once
    assert time.monotonic() - t0 < 1.0
