"""The control plane under load, through a real server on loopback: vLLM's /pause (abort, wait,
keep) and /resume, SGLang's /pause_generation (abort, retract, in_place) and
/continue_generation, prime-rl's /update_weights while paused, and the cache routes. With
requests in flight: nothing is lost, and every token's logprob is a full float32 forward of the
weights that made it (1e-4), the response naming each version and where it began."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import moved_copy, reference_logprobs
from tests.helpers.server import server_process, thread_server, wait_idle

PROMPTS = ["The quick brown fox jumps over the lazy", "Once upon a time", "Hello there, my"]
TOKENS = 60
LONG = 400  # in flight for sure when the pause comes, on any machine


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    return moved_copy(tiny_dir, tmp_path_factory.mktemp("tiny_next"))


@pytest.fixture
def served(tiny_dir: Path) -> Iterator[tuple[str, LoadedModel]]:
    """A server of its own per test: its model's weights change under the test."""
    model = load_model(str(tiny_dir))
    with thread_server(model, EngineConfig(max_num_seqs=16, prefill_chunk=64)) as (url, _):
        yield url, model


@pytest.fixture(scope="module")
def kept_server(tiny_dir: Path) -> Iterator[tuple[str, LoadedModel]]:
    """One server for the tests that pause and resume but change no weights (`kept`)."""
    model = load_model(str(tiny_dir))
    with thread_server(model, EngineConfig(max_num_seqs=16, prefill_chunk=64)) as (url, _):
        yield url, model


@pytest.fixture
def kept(kept_server: tuple[str, LoadedModel]) -> Iterator[tuple[str, LoadedModel]]:
    """The module's server as a fresh one is: idle, running, weights as loaded, and its prefix
    cache flushed (each test prefills its prompts as on a server of its own); a test that
    failed while paused leaves it resumed."""
    base, model = kept_server
    assert httpx.get(base + "/health", timeout=10).json()["weight_version"]["counter"] == 0
    post(base, "/flush_cache")
    yield base, model
    if httpx.get(base + "/is_paused", timeout=10).json()["is_paused"]:
        post(base, "/resume")
    wait_idle(base, 120)


class Stream:
    """One streamed completion in a thread: its chunks as they come."""

    def __init__(self, base: str, model: str, prompt: str, tokens: int = TOKENS) -> None:
        self.body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                     "ignore_eos": True, "logprobs": 1, "stream": True,
                     "return_token_ids": True}  # fmt: skip
        self.base, self.chunks, self.got = base, [], threading.Event()
        self.ids: list[int] = []
        self.prompt_ids: list[int] = []
        self.lps: list[float] = []
        self.finish: str | None = None
        self.spans: list[dict[str, Any]] | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream("POST", self.base + "/v1/completions", json=self.body,
                          timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ch = json.loads(line[6:])["choices"][0]
                self.prompt_ids = ch.get("prompt_token_ids") or self.prompt_ids
                self.ids += ch.get("token_ids") or []
                if ch["logprobs"]:
                    self.lps += ch["logprobs"]["token_logprobs"]
                self.finish = ch["finish_reason"] or self.finish
                self.spans = ch.get("weight_versions", self.spans)
                self.got.set()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive()


def post(base: str, path: str, **kw: Any) -> httpx.Response:
    r = httpx.post(base + path, timeout=120, **kw)
    assert r.status_code == 200, r.text
    return r


def check(stream: Stream, models: list[LoadedModel]) -> None:
    """Every token's logprob against a full forward of the weights its span names."""
    spans = stream.spans or [{"counter": 0, "start": 0}]
    starts = [s["start"] for s in spans] + [len(stream.ids)]
    full = stream.prompt_ids + stream.ids
    n = len(stream.prompt_ids)
    for span, a, b in zip(spans, starts, starts[1:]):
        ref = reference_logprobs(models[span["counter"]], full)
        for i in range(a, b):
            assert abs(stream.lps[i] - ref[n - 1 + i][stream.ids[i]]) < 1e-4, (span, i)


def start(base: str, model: str, tokens: int = TOKENS) -> list[Stream]:
    streams = [Stream(base, model, p, tokens) for p in PROMPTS]
    for s in streams:
        assert s.got.wait(60)
    return streams


def frozen(streams: list[Stream], seconds: float = 0.3) -> bool:
    before = [len(s.ids) for s in streams]
    time.sleep(seconds)
    return before == [len(s.ids) for s in streams]


@pytest.mark.parametrize("how", ["keep", "in_place", "retract"])
def test_a_pause_in_place_changes_nothing(kept: tuple[str, LoadedModel], how: str) -> None:
    """Paused in place (or retracted and prefilled again), resumed: the same tokens and
    logprobs as a run without the pause; a request sent while paused waits, then runs."""
    base, model = kept
    streams = start(base, model.name)
    if how == "keep":
        assert post(base, "/pause", params={"mode": "keep"}).json()["status"] == "paused"
    else:
        post(base, "/pause_generation", json={"mode": how})
    assert httpx.get(base + "/is_paused").json() == {"is_paused": True}
    late = Stream(base, model.name, "A late request", 8)
    assert frozen(streams + [late]) and not late.ids
    post(base, "/resume" if how == "keep" else "/continue_generation")
    for s in [*streams, late]:
        s.join()
        assert s.finish == "length" and s.spans is None
        check(s, [model])
    assert [len(s.ids) for s in streams] == [TOKENS] * 3 and len(late.ids) == 8


def test_pause_abort_and_wait(kept: tuple[str, LoadedModel]) -> None:
    base, model = kept
    streams = start(base, model.name)
    body = post(base, "/pause", params={"mode": "abort"}).json()
    assert body["status"] == "paused" and body["aborted"] == 3
    for s in streams:
        s.join()
        assert s.finish == "abort" and 0 < len(s.ids) < TOKENS
        check(s, [model])  # what came back is right, up to where it stopped
    late = Stream(base, model.name, "A late request", 8)
    assert frozen([late]) and not late.ids
    post(base, "/resume")
    late.join()
    assert late.finish == "length"
    # wait: the pause is answered once the requests in flight have finished
    streams = start(base, model.name)
    post(base, "/pause", params={"mode": "wait"})
    assert all(len(s.ids) == TOKENS for s in streams)
    post(base, "/resume")
    for s in streams:
        s.join()
        assert s.finish == "length"


@pytest.mark.parametrize("how", ["keep", "retract"])
def test_new_weights_while_paused(
    served: tuple[str, LoadedModel], tiny: LoadedModel, new_dir: Path, how: str
) -> None:
    """prime-rl's loop: pause in place, new weights, resume, requests in flight. They finish
    on the new weights, prefilled again with them: each token is a full forward of the
    version that made it, and the response says where the new version began."""
    base, model = served
    streams = start(base, model.name, LONG)
    if how == "keep":
        post(base, "/pause", params={"mode": "keep"})
    else:
        post(base, "/pause_generation", json={"mode": "retract"})
    time.sleep(0.3)  # the chunks made before the pause reach the client
    cut = [len(s.ids) for s in streams]
    r = post(base, "/update_weights", json={"weight_dir": str(new_dir), "weight_version": "s1"})
    assert r.json()["weight_version"] == {"counter": 1, "tag": "s1"}
    late = Stream(base, model.name, "A late request", 8)
    assert frozen(streams + [late])
    post(base, "/resume")
    new = load_model(str(new_dir))
    for s, c in zip(streams, cut):
        s.join()
        assert s.finish == "length" and len(s.ids) == LONG and c < LONG
        assert s.spans == [{"counter": 0, "tag": None, "start": 0},
                           {"counter": 1, "tag": "s1", "start": c}]  # fmt: skip
        check(s, [tiny, new])  # `model` itself holds the new weights by now
    late.join()
    assert late.spans is None
    check(late, [new, new])


def test_cache_routes(kept: tuple[str, LoadedModel]) -> None:
    base, model = kept
    assert post(base, "/flush_cache").text == "Cache flushed.\n"
    assert httpx.get(base + "/flush_cache").status_code == 200
    assert post(base, "/reset_prefix_cache").content == b""
    assert httpx.post(base + "/pause", params={"mode": "nope"}).status_code == 400
    r = httpx.post(base + "/pause_generation", json={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = httpx.post(base + "/update_weights", json={"weight_dir": "/nowhere"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight_dir"


def test_through_the_engine_process(tiny_dir: Path, new_dir: Path) -> None:
    """The same commands cross to the engine's own process."""
    with server_process(["--model", str(tiny_dir), "--log-level", "warning"]) as srv:
        base = srv.base
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        streams = start(base, name, LONG)
        post(base, "/pause_generation", json={"mode": "in_place"})
        post(base, "/update_weights", json={"weight_dir": str(new_dir)})
        assert httpx.get(base + "/health").json()["engine"]["paused"] == "keep"
        post(base, "/continue_generation")
        for s in streams:
            s.join()
            assert s.finish == "length" and s.spans is not None
        check(streams[0], [load_model(str(tiny_dir)), load_model(str(new_dir))])
