"""The command records (engine/commands.py): every one frozen and picklable, as the pipe to the
engine's child process carries them; each answered one says what its answer is when the engine
that held it is gone."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest

from omlx_logprobs.control import (
    AdapterChange,
    Control,
    ControlResult,
    PauseMode,
    WeightUpdate,
    WeightUpdateResult,
    WeightVersion,
)
from omlx_logprobs.engine.commands import (
    Abort,
    BeginShutdown,
    ChangeAdapter,
    Command,
    ControlCommand,
    Notice,
    Stop,
    Submit,
    Train,
    UpdateWeights,
    posted,
)
from omlx_logprobs.training.calls import CreateRun, DatumPass, LoraSpec, TrainAnswer
from omlx_logprobs.transport.messages import Reply
from omlx_logprobs.types import EngineRequest, SamplingParams

EXAMPLES: list[Command[Any]] = [
    Submit(EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, logprobs=True), n=2)),
    Abort("r1"),
    BeginShutdown(2.5),
    Stop(),
    UpdateWeights(WeightUpdate("/weights/step-7", abort_in_flight=True, tag="step-7")),
    ChangeAdapter(AdapterChange("one", "/adapters/one", replace=True)),
    ControlCommand(Control("pause", PauseMode.RETRACT)),
    Train(CreateRun("session-1:train:0", LoraSpec(8, seed=3, mlp=False))),
]


def records() -> set[type]:
    """Every concrete command record: the dataclasses under `Command`, at any depth."""
    found, todo = set(), [Command]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if dataclasses.is_dataclass(sub):
                found.add(sub)
    return found


def test_every_record_has_an_example() -> None:
    assert {type(c) for c in EXAMPLES} == records()


@pytest.mark.parametrize("command", EXAMPLES, ids=lambda c: type(c).__name__)
def test_records_are_frozen_and_picklable(command: Command[Any]) -> None:
    sent = pickle.loads(pickle.dumps((7, command)))
    assert sent == (7, command) and type(sent[1]) is type(command)
    for field in dataclasses.fields(command):  # type: ignore[arg-type]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(command, field.name, None)


def test_answers_when_refused() -> None:
    v = WeightVersion(3, "step-3")
    assert [c.answered for c in EXAMPLES] == [False] * 4 + [True] * 4
    assert all(isinstance(c, Notice) is (not c.answered) for c in EXAMPLES)
    update, adapter, control, train = EXAMPLES[4:]
    assert update.refused("gone", v) == WeightUpdateResult(v, "gone")
    assert adapter.refused("gone", v) == "gone"
    assert control.refused("gone", v) == ControlResult(False, error="gone")
    assert train.refused("gone", v) == TrainAnswer(error="gone", user=False)
    assert pickle.loads(pickle.dumps(Reply(9, ControlResult(True, held=2)))) == Reply(
        9, ControlResult(True, held=2)
    )


def test_a_notice_is_done_once_posted() -> None:
    done = posted()
    assert done.done() and done.result() is None
    seen: list[Any] = []
    done.add_done_callback(seen.append)  # called at once, kept nowhere
    assert seen == [done]


def test_training_calls_carry_numpy_arrays() -> None:
    """A datum's arrays cross the pipe as they are (ids and loss inputs, their dtypes kept)."""
    weights = {"weights": np.array([0.5, 1.0, 2.0], np.float32)}
    call = DatumPass("m", np.array([1, 2, 3], np.int32), weights, "cross_entropy")
    got = pickle.loads(pickle.dumps(Train(call))).call
    assert got.tokens.dtype == np.int32 and got.tokens.tolist() == [1, 2, 3]
    assert got.inputs["weights"].dtype == np.float32 and got.loss_fn == "cross_entropy"
