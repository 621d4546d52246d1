"""Several models in one server (`--model` given twice): each request reaches its own model's
engine (logprobs against an independent forward pass of each, 1e-4), unknown names are 404s,
and under `--max-loaded-models` or `--max-model-memory-mib` models are unloaded (the engine
process exits) and loaded on demand with no request lost, or a 503 with Retry-After when the
model in the way stays busy past `--model-load-timeout-s`."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import moved_copy, reference_logprobs, tiny_model_dir
from tests.helpers.server import ServerProcess, assert_openai_error, engine_child, server_process

PROMPT = "The quick brown fox jumps over the lazy"
TWO = ["--served-model-name", "alpha", "--served-model-name", "beta"]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """The tiny model's architecture and tokenizer with weights of another seed."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_other"), tiny_dir, seed=4321)


@pytest.fixture(scope="module")
def moved_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """The tiny model's weights after a training step (every weight moved)."""
    return moved_copy(tiny_dir, tmp_path_factory.mktemp("tiny_moved"))


@pytest.fixture(scope="module")
def other(other_dir: Path) -> LoadedModel:
    return load_model(str(other_dir))


def serve_two(tiny_dir: Path, other_dir: Path, *extra: str) -> Any:
    models = ["--model", str(tiny_dir), "--model", str(other_dir)]
    return server_process([*models, *TWO, "--log-level", "info", *extra])


@pytest.fixture(scope="module")
def both(tiny_dir: Path, other_dir: Path) -> Iterator[ServerProcess]:
    """Engines as threads of the server (faster to start; the other tests use processes)."""
    with serve_two(tiny_dir, other_dir, "--engine", "thread") as s:
        yield s


def completion(base: str, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, **kw}  # fmt: skip
    return httpx.post(base + "/v1/completions", json=body, timeout=120)


def check_against(model: LoadedModel, body: dict[str, Any]) -> None:
    """The generated tokens' logprobs equal a full forward pass of `model` (1e-4)."""
    choice = body["choices"][0]
    prompt, out = choice["prompt_token_ids"], choice["token_ids"]
    assert out
    ref = reference_logprobs(model, prompt + out)[len(prompt) - 1 : -1]
    got = choice["logprobs"]["token_logprobs"]
    for i, tok in enumerate(out):
        assert abs(got[i] - ref[i][tok]) < 1e-4, (i, got[i], ref[i][tok])


def served(base: str, model: str, refs: dict[str, LoadedModel]) -> None:
    r = completion(base, model)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    check_against(refs[model], r.json())


def states(base: str) -> dict[str, str]:
    health = httpx.get(base + "/health", timeout=10).json()
    return {name: m["state"] for name, m in health["models"].items()}


def test_each_model_is_its_own(
    both: ServerProcess, tiny_dir: Path, tiny: LoadedModel, other: LoadedModel
) -> None:
    refs = {"alpha": tiny, "beta": other}
    bodies = {}
    for name in ("alpha", "beta", "alpha"):
        r = completion(both.base, name)
        assert r.status_code == 200, r.text
        check_against(refs[name], r.json())
        bodies[name] = r.json()
    assert bodies["alpha"]["choices"][0]["logprobs"] != bodies["beta"]["choices"][0]["logprobs"]
    # chat, streamed, to the second model: every chunk names it
    body = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "logprobs": True}  # fmt: skip
    with httpx.stream("POST", both.base + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"beta"}
    cards = httpx.get(both.base + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["loaded"], c["max_model_len"]) for c in cards] == [
        ("alpha", True, 2048),
        ("beta", True, 2048),
    ]
    health = httpx.get(both.base + "/health", timeout=10).json()
    assert health["status"] == "ok" and set(health["models"]) == {"alpha", "beta"}
    assert health["engine"] == health["models"]["alpha"]["engine"]  # the default's, on top
    # float32 weights: the estimate is their size on disk (the header aside) plus 10%
    size = (tiny_dir / "model.safetensors").stat().st_size
    assert {m["memory_mib"] for m in health["models"].values()} == {math.ceil(1.1 * size / 2**20)}


def test_tokenizer_routes_take_the_model(both: ServerProcess) -> None:
    r = httpx.post(both.base + "/tokenize", json={"model": "beta", "prompt": "hi"}, timeout=10)
    assert r.status_code == 200 and r.json()["count"] >= 1
    assert httpx.get(both.base + "/tokenizer_info", timeout=10).json()["model"] == "alpha"
    info = httpx.get(both.base + "/tokenizer_info", params={"model": "beta"}, timeout=10)
    assert info.json()["model"] == "beta"
    r = httpx.post(both.base + "/detokenize", json={"model": "beta", "tokens": [1]}, timeout=10)
    assert r.status_code == 200


def test_unknown_model_is_a_404(both: ServerProcess) -> None:
    err = assert_openai_error(completion(both.base, "gamma"), 404, "model")
    assert "`gamma`" in err["message"] and "`alpha`, `beta`" in err["message"]
    body = {"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(httpx.post(both.base + "/v1/chat/completions", json=body), 404, "model")
    r = httpx.post(both.base + "/tokenize", json={"model": "gamma", "prompt": "x"})
    assert_openai_error(r, 404, "model")
    r = httpx.get(both.base + "/tokenizer_info", params={"model": "gamma"})
    assert_openai_error(r, 404, "model")
    r = httpx.post(both.base + "/update_weights_from_disk", json={"model": "gamma",
                                                                  "model_path": "/x"})  # fmt: skip
    assert_openai_error(r, 404, "model")
    assert completion(both.base, "alpha").status_code == 200  # still serving


def test_one_loaded_at_a_time(
    tiny_dir: Path, other_dir: Path, moved_dir: Path, tiny: LoadedModel, other: LoadedModel
) -> None:
    """--max-loaded-models 1 (engine processes): each switch unloads the other model, whose
    engine process exits; concurrent requests to both all succeed with their model's numbers;
    weights updated in place come back, under their version, when the model is loaded again."""
    refs = {"alpha": tiny, "beta": other}
    with serve_two(tiny_dir, other_dir, "--max-loaded-models", "1") as s:
        assert states(s.base) == {"alpha": "loaded", "beta": "unloaded"}
        cards = httpx.get(s.base + "/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["loaded"]) for c in cards] == [("alpha", True), ("beta", False)]
        first = engine_child(s.proc.pid)
        served(s.base, "beta", refs)  # waits for beta's load
        assert states(s.base) == {"alpha": "unloaded", "beta": "loaded"}
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
        assert engine_child(s.proc.pid) != first

        names = ["alpha", "beta"] * 4
        with ThreadPoolExecutor(len(names)) as pool:
            responses = list(pool.map(lambda m: (m, completion(s.base, m)), names))
        for name, r in responses:
            assert r.status_code == 200, r.text
            check_against(refs[name], r.json())
        log = s.log()
        # alpha was loaded again for its four requests, which shared the load
        assert 1 <= log.count("model alpha loaded") < 4 and log.count("model beta unloaded") >= 1

        update = {"model": "alpha", "model_path": str(moved_dir), "weight_version": "step-1"}
        r = httpx.post(s.base + "/update_weights_from_disk", json=update, timeout=120)
        assert r.status_code == 200, r.text
        served(s.base, "beta", refs)  # alpha unloaded, its update remembered
        health = httpx.get(s.base + "/health", timeout=10).json()
        assert health["models"]["alpha"]["state"] == "unloaded"
        assert health["weight_version"] == {"counter": 1, "tag": "step-1"}
        r = completion(s.base, "alpha")
        assert r.status_code == 200, r.text
        assert r.json()["weight_version"] == {"counter": 1, "tag": "step-1"}
        check_against(load_model(str(moved_dir)), r.json())
    assert "threads left: none" in s.log()  # loads and unloads left no thread behind


def test_busy_model_past_the_timeout_is_a_503(
    tiny_dir: Path, other_dir: Path, tiny: LoadedModel, other: LoadedModel
) -> None:
    """A memory budget for one model (engines as threads): while a long stream keeps alpha busy
    past --model-load-timeout-s, a request for beta is a 503 with Retry-After; once alpha is
    idle, beta loads and answers."""
    extra = ["--max-model-memory-mib", "20", "--model-load-timeout-s", "1", "--engine", "thread"]
    with serve_two(tiny_dir, other_dir, *extra) as s:
        assert states(s.base) == {"alpha": "loaded", "beta": "unloaded"}
        body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True,
                "stream": True}  # fmt: skip
        answer: dict[str, Any] = {}

        def ask_beta() -> None:
            began = time.monotonic()
            r = completion(s.base, "beta")
            answer.update(r=r, waited=time.monotonic() - began)

        with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            thread = threading.Thread(target=ask_beta)
            thread.start()
            thread.join(60)
        r = answer["r"]
        err = assert_openai_error(r, 503, "model")
        assert r.headers["retry-after"] == "5" and "`alpha`" in err["message"]
        assert 0.9 < answer["waited"] < 30
        served(s.base, "beta", {"alpha": tiny, "beta": other})  # alpha went idle: beta loads
        assert states(s.base) == {"alpha": "unloaded", "beta": "loaded"}
        served(s.base, "alpha", {"alpha": tiny, "beta": other})


@pytest.fixture(scope="module")
def one_at_a_time_server(tiny_dir: Path, other_dir: Path) -> Iterator[ServerProcess]:
    """--max-loaded-models 1, engines as threads: the server of the lists test and the fairness
    test (`one_at_a_time` gives it to each as it started)."""
    extra = ["--max-loaded-models", "1", "--model-load-timeout-s", "30", "--engine", "thread"]
    with serve_two(tiny_dir, other_dir, *extra) as s:
        yield s


@pytest.fixture
def one_at_a_time(one_at_a_time_server: ServerProcess) -> ServerProcess:
    """The shared server as it started, alpha loaded and beta not: a test before that loaded
    beta has alpha loaded again (the lists test comes first, so it meets beta never loaded)."""
    s = one_at_a_time_server
    if states(s.base) != {"alpha": "loaded", "beta": "unloaded"}:
        assert completion(s.base, "alpha").status_code == 200
    assert states(s.base) == {"alpha": "loaded", "beta": "unloaded"}
    return s


def test_lists_describe_a_model_not_loaded(one_at_a_time: ServerProcess, other_dir: Path) -> None:
    """/v1/models and Ollama's /api/tags and /api/show describe the model that is not loaded
    from its files and its tokenizer alone: it stays unloaded."""
    s = one_at_a_time
    cards = httpx.get(s.base + "/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["loaded"], c["max_model_len"], c["context_length"]) for c in cards] == [
        ("alpha", True, 2048, 2048),
        ("beta", False, 2048, 2048),
    ]
    assert cards[1]["capabilities"] == cards[0]["capabilities"]
    tags = httpx.get(s.base + "/api/tags", timeout=30).json()["models"]
    beta = next(m for m in tags if m["name"] == "beta")
    assert beta["size"] == (other_dir / "model.safetensors").stat().st_size
    assert beta["details"]["format"] == "safetensors"
    assert beta["details"]["family"] == "llama"
    assert beta["details"]["quantization_level"] == "F32"
    shown = httpx.post(s.base + "/api/show", json={"model": "beta"}, timeout=30).json()
    assert shown["model_info"]["llama.context_length"] == 2048
    assert shown["capabilities"][0] == "completion"
    assert states(s.base) == {"alpha": "loaded", "beta": "unloaded"}


def test_one_loaded_at_a_time_is_fair_and_loads_nothing_it_need_not(
    one_at_a_time: ServerProcess, tiny: LoadedModel, other: LoadedModel
) -> None:
    """--max-loaded-models 1: a request with an unknown field is a 400 before any load; the
    tokenizer routes read an unloaded model's tokenizer without loading it; and a request for
    the unloaded model is served while requests for the loaded one keep coming (they wait
    behind it, so the loaded model drains), every answer with its model's numbers."""
    refs = {"alpha": tiny, "beta": other}
    s = one_at_a_time
    loaded = {"alpha": "loaded", "beta": "unloaded"}
    assert_openai_error(completion(s.base, "beta", foo=1), 400, "foo")
    body = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "bar": 2}
    r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(r, 400, "bar")
    r = httpx.post(s.base + "/tokenize", json={"model": "beta", "prompt": PROMPT}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == list(
        other.tokenizer.encode(PROMPT, add_special_tokens=True)
    )
    r = httpx.post(s.base + "/detokenize", json={"model": "beta", "tokens": r.json()["tokens"]})
    assert r.status_code == 200 and PROMPT in r.json()["prompt"]
    info = httpx.get(s.base + "/tokenizer_info", params={"model": "beta"}, timeout=30).json()
    assert info["model"] == "beta" and info["vocab_size"] == len(other.vocab)
    assert states(s.base) == loaded

    stop = threading.Event()

    def alpha_loop(n: int) -> list[httpx.Response]:
        out = []
        while not stop.is_set():  # lengths apart: they end at different steps
            out.append(completion(s.base, "alpha", max_tokens=n, ignore_eos=True))
        return out

    with ThreadPoolExecutor(6) as pool:
        loops = [pool.submit(alpha_loop, 40 + 23 * i) for i in range(6)]
        time.sleep(0.5)  # alpha busy, continuously
        began = time.monotonic()
        r = completion(s.base, "beta")
        waited = time.monotonic() - began
        time.sleep(0.5)  # alpha's requests that waited behind beta's are answered
        stop.set()
        alphas = [r for f in loops for r in f.result()]
    assert r.status_code == 200, r.text
    check_against(other, r.json())
    assert waited < 25  # not the 30 s timeout: alpha drained for it
    assert len(alphas) >= 3
    for a in alphas:
        assert a.status_code == 200, a.text
        check_against(refs["alpha"], a.json())
