"""transport/encoder.py and runner/encoder.py alone: requests waiting together run in batches
within the rows and padded tokens allowed, shortest first, each vector equal to its input's
alone (right padding is masked out) and to sentence-transformers'; aborted requests are
skipped, a generation request, new weights and adapters refused, pauses answered."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.control import Control, WeightUpdate
from omlx_logprobs.engine.commands import Abort, ControlCommand, Submit, UpdateWeights
from omlx_logprobs.runner.encoder import EncoderRunner
from omlx_logprobs.transport.encoder import ONLY_EMBEDS, EncoderTransport
from omlx_logprobs.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from tests.helpers.embedding import compare, reference_embeddings
from tests.helpers.encoder import encoder_model_dir

TEXTS = ["paris", "the capital of france is paris", "bananas", "which river runs through paris"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encoder_model_dir(tmp_path_factory.mktemp("bert"))


def ids_of(path: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return [list(tok.encode(t)) for t in texts]


def request(i: int, ids: list[int], embed: bool = True) -> EngineRequest:
    return EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=0), embed=embed)


def test_batches_within_bounds(bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = ids_of(bert, TEXTS) * 3
    shapes: list[tuple[int, int]] = []  # (rows, padded width) of each forward
    embed = EncoderRunner.embed

    def counted(self: EncoderRunner, rows: list[list[int]]) -> list[np.ndarray]:
        shapes.append((len(rows), max(map(len, rows))))
        return embed(self, rows)

    monkeypatch.setattr(EncoderRunner, "embed", counted)
    outs: dict[str, RequestOutput] = {}
    done = threading.Event()

    def deliver(batch: list[RequestOutput]) -> None:
        outs.update((o.request_id, o) for o in batch)
        if len(outs) == len(ids):
            done.set()

    t = EncoderTransport(bert, "mean", 0, max_rows=4, max_tokens=24)
    for i, x in enumerate(ids):  # all waiting when the thread starts: taken together
        t.post(Submit(request(i, x)))
    t.start(deliver, lambda rids, why: None)
    assert done.wait(60)
    t.shutdown(5)
    assert len(shapes) > 1 and sum(r for r, _ in shapes) == len(ids)
    assert all(r <= 4 and r * w <= 24 for r, w in shapes), shapes
    assert [w for _, w in shapes] == sorted(w for _, w in shapes)  # shortest first
    runner = EncoderRunner(bert, "mean", 0)
    want = reference_embeddings(bert, TEXTS)
    for i, x in enumerate(ids):
        out = outs[f"r{i}"]
        assert out.finished and out.finish_reason is FinishReason.LENGTH
        assert out.prompt_tokens == len(x) and out.embedding is not None
        alone = runner.embed([x])[0]
        assert np.abs(out.embedding - alone).max() < 1e-5
        v = out.embedding / np.linalg.norm(out.embedding)  # normalizing is the API's
        cos, worst = compare(v, want[i % len(TEXTS)])
        assert cos > 0.99999 and worst < 1e-4


def test_aborted_and_refused(bert: Path) -> None:
    outs: list[RequestOutput] = []
    done = threading.Event()

    def deliver(batch: list[RequestOutput]) -> None:
        outs.extend(batch)
        if len(outs) >= 3:
            done.set()

    t = EncoderTransport(bert, "cls", 0, max_rows=8, max_tokens=512)
    t.post(Submit(request(0, [2, 40, 3])))
    t.post(Abort("r0"))  # aborted while it waits: answered without a vector
    t.post(Submit(request(1, [2, 41, 3])))
    t.start(deliver, lambda rids, why: None)
    t.post(Submit(request(2, [2, 40, 3], embed=False)))  # generation: refused at once
    assert done.wait(60)
    by_id = {o.request_id: o for o in outs}
    assert by_id["r0"].finish_reason is FinishReason.ABORT and by_id["r0"].embedding is None
    assert by_id["r1"].embedding is not None and by_id["r1"].embedding.shape == (32,)
    assert by_id["r2"].finish_reason is FinishReason.ERROR and by_id["r2"].error == ONLY_EMBEDS
    answer = t.post(UpdateWeights(WeightUpdate(str(bert)))).result(5)
    assert answer.error == ONLY_EMBEDS
    for action in ("pause", "flush", "resume"):  # nothing to pause: answered, no error
        done_ = t.post(ControlCommand(Control(action))).result(5)
        assert done_.error is None and not done_.paused
    assert t.state == "ok" and t.snapshot().waiting == 0
    t.shutdown(5)
    assert t.state == "stopped"


def test_a_load_error_is_raised_by_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    t = EncoderTransport(tmp_path, "mean", 0, max_rows=1, max_tokens=1)
    with pytest.raises(Exception):  # noqa: B017 (mlx-embeddings' own error for missing files)
        t.start(lambda b: None, lambda rids, why: None)
    assert t.state == "stopped"
