"""LoRA adapters through the real server (`--lora` at start, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` at run time, the engine in its own process) and the `openai` client:
requests on adapters and on the base model at once each equal a full forward pass of their own
model (the adapter fused by mlx-lm), 1e-4; loading and unloading under traffic loses no request;
bad adapters are 400s and 404s and the server keeps serving; new base weights keep the adapters."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import moved_copy, reference_logprobs, tiny_model_dir
from tests.helpers.lora import fused, make_adapter
from tests.helpers.server import (
    ServerProcess,
    assert_openai_error,
    engine_child,
    server_process,
)

PROMPTS = ["The quick brown fox jumps over the lazy", "Once upon a time", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "one": make_adapter(root / "one", tiny_dir, seed=11),
        "two": make_adapter(root / "two", tiny_dir, seed=12, rank=8, scale=4.0, num_layers=1),
        "three": make_adapter(root / "three", tiny_dir, seed=13, rank=2,
                              keys=["self_attn.v_proj", "mlp.down_proj"]),
    }  # fmt: skip


@pytest.fixture(scope="module")
def refs(tiny_dir: Path, tiny: LoadedModel, adapters: dict[str, Path]) -> dict[str, LoadedModel]:
    return {"tiny": tiny, **{n: fused(tiny_dir, p) for n, p in adapters.items()}}


@pytest.fixture(scope="module")
def server(tiny_dir: Path, adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--lora",
            f"one={adapters['one']}", "--log-level", "info"]  # fmt: skip
    with server_process(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)


def post(server: ServerProcess, route: str, **body: Any) -> httpx.Response:
    return httpx.post(server.base + route, json=body, timeout=120)


def check(client: openai.OpenAI, model: str, ref: LoadedModel, prompt: str, **kw: Any) -> None:
    """One completion on `model`; its logprobs against a full forward pass of `ref`."""
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, logprobs=2, temperature=kw.pop("t", 0),
        extra_body={"return_token_ids": True, "ignore_eos": True}, **kw,
    )  # fmt: skip
    assert r.model == model
    choice = r.choices[0].model_dump()
    ids, out = choice["prompt_token_ids"], choice["token_ids"]
    want = reference_logprobs(ref, ids + out)[len(ids) - 1 : -1]
    got = choice["logprobs"]["token_logprobs"]
    assert len(out) == 6
    for i, tok in enumerate(out):
        assert abs(got[i] - want[i][tok]) < 1e-4, (model, i, got[i], want[i][tok])


def test_models_lists_the_adapters_with_their_parent(server: ServerProcess) -> None:
    data = httpx.get(server.base + "/v1/models").json()["data"]
    cards = {c["id"]: c for c in data}
    assert cards["one"]["parent"] == "tiny" and cards["one"]["root"].endswith("one")
    assert "parent" not in cards["tiny"]
    health = httpx.get(server.base + "/health").json()
    assert health["models"]["tiny"]["adapters"] == ["one"]


def test_adapters_and_the_base_at_once_each_equal_their_model(
    server: ServerProcess, client: openai.OpenAI, adapters: dict[str, Path], refs: dict
) -> None:
    r = post(server, "/v1/load_lora_adapter", lora_name="two", lora_path=str(adapters["two"]))
    assert r.status_code == 200, r.text
    jobs = [(m, p, t) for m in ("tiny", "one", "two") for p in PROMPTS for t in (0, 0.8)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = [pool.submit(check, client, m, refs[m], p, t=t, seed=5) for m, p, t in jobs]
        for f in done:
            f.result()
    chat = client.chat.completions.create(
        model="two", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.model == "two"
    assert post(server, "/v1/unload_lora_adapter", lora_name="two").status_code == 200


def test_load_and_unload_under_traffic_lose_no_request(
    server: ServerProcess, client: openai.OpenAI, adapters: dict[str, Path], refs: dict
) -> None:
    """Requests on the base and on `one` run all along while `three` is loaded, used and
    unloaded (twice); every one of them is answered with its model's numbers."""
    stop = False

    def traffic(model: str) -> int:
        n = 0
        while not stop:
            check(client, model, refs[model], PROMPTS[n % 3])
            n += 1
        return n

    path = str(adapters["three"])
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(traffic, m) for m in ("tiny", "one", "tiny", "one")]
        try:
            for _ in range(2):
                r = post(server, "/v1/load_lora_adapter", lora_name="three", lora_path=path)
                assert r.status_code == 200, r.text
                check(client, "three", refs["three"], PROMPTS[0])
                assert post(server, "/v1/unload_lora_adapter", lora_name="three").status_code == 200
                r = post(server, "/v1/completions", model="three", prompt="x", max_tokens=1)
                assert_openai_error(r, 404, "model")
        finally:
            stop = True
        counts = [f.result() for f in running]
    assert all(n > 0 for n in counts)
    ids = {c["id"] for c in httpx.get(server.base + "/v1/models").json()["data"]}
    assert ids == {"tiny", "one"}


def test_bad_adapters_are_refused_and_the_server_keeps_serving(
    server: ServerProcess, client: openai.OpenAI, tmp_path: Path, adapters: dict[str, Path],
    refs: dict,
) -> None:  # fmt: skip
    load = "/v1/load_lora_adapter"
    r = post(server, load, lora_name="x", lora_path=str(tmp_path / "nowhere"))
    assert "not a directory" in assert_openai_error(r, 400, "lora_path")["message"]
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(adapters["one"] / "adapter_config.json", wrong)
    w = dict(mx.load(str(adapters["one"] / "adapters.safetensors")))
    w["model.layers.0.mlp.up_proj.lora_a"] = mx.zeros((48, 4))  # the model's layer takes 64
    mx.save_safetensors(str(wrong / "adapters.safetensors"), w)
    r = post(server, load, lora_name="x", lora_path=str(wrong))
    assert "up_proj" in assert_openai_error(r, 400, "lora_path")["message"]
    for taken in ("one", "tiny"):
        r = post(server, load, lora_name=taken, lora_path=str(adapters["two"]))
        assert assert_openai_error(r, 400, "lora_name")["code"] == "adapter_exists"
    r = post(server, load, lora_name="x", lora_path=str(adapters["two"]), base_model_name="nope")
    assert_openai_error(r, 404, "base_model_name")
    r = post(server, load, lora_name="x", lora_path=str(adapters["two"]), base_model_name="one")
    assert_openai_error(r, 400, "base_model_name")
    r = post(server, load, lora_name="x", lora_path=str(adapters["two"]), extra=1)
    assert_openai_error(r, 400, "extra")
    r = post(server, "/v1/unload_lora_adapter", lora_name="nope")
    assert assert_openai_error(r, 404, "lora_name")["code"] == "adapter_not_found"
    r = post(server, "/v1/completions", model="nope", prompt="x", max_tokens=1)
    assert_openai_error(r, 404, "model")
    check(client, "one", refs["one"], PROMPTS[1])
    check(client, "tiny", refs["tiny"], PROMPTS[1])


def test_new_base_weights_keep_the_adapters(
    server: ServerProcess, client: openai.OpenAI, tiny_dir: Path, adapters: dict[str, Path],
    tmp_path: Path, refs: dict,
) -> None:  # fmt: skip
    """An adapter is a delta on whatever base serves: after /update_weights_from_disk, `one`
    equals mlx-lm's fuse of it into the new weights; `load_inplace` replaces it."""
    moved = moved_copy(tiny_dir, tmp_path)
    r = post(server, "/update_weights_from_disk", model_path=str(moved))
    assert r.status_code == 200, r.text
    try:
        check(client, "one", fused(moved, adapters["one"]), PROMPTS[0])
        r = post(server, "/v1/load_lora_adapter", lora_name="one",
                 lora_path=str(adapters["two"]), load_inplace=True)  # fmt: skip
        assert r.status_code == 200 and "replaced" in r.text, r.text
        check(client, "one", fused(moved, adapters["two"]), PROMPTS[0])
    finally:
        r = post(server, "/update_weights_from_disk", model_path=str(tiny_dir))
        assert r.status_code == 200
        r = post(server, "/v1/load_lora_adapter", lora_name="one",
                 lora_path=str(adapters["one"]), load_inplace=True)  # fmt: skip
        assert r.status_code == 200
    check(client, "one", refs["one"], PROMPTS[0])


def test_adapters_come_back_with_a_restarted_engine(
    server: ServerProcess, client: openai.OpenAI, adapters: dict[str, Path], refs: dict
) -> None:
    """The engine process killed: the new one loads `--lora`'s adapter and the one loaded at
    run time, before it serves."""
    r = post(server, "/v1/load_lora_adapter", lora_name="three", lora_path=str(adapters["three"]))
    assert r.status_code == 200, r.text
    first = engine_child(server.proc.pid)
    os.kill(first, signal.SIGKILL)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.5)
        h = httpx.get(server.base + "/health", timeout=10)
        if h.status_code == 200 and h.json()["engine"] is not None:
            break
    assert engine_child(server.proc.pid) != first
    for name in ("one", "three", "tiny"):
        check(client, name, refs[name], PROMPTS[2])
    assert post(server, "/v1/unload_lora_adapter", lora_name="three").status_code == 200


def test_adapters_come_back_when_their_model_is_loaded_again(
    tiny_dir: Path, adapters: dict[str, Path], refs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--max-loaded-models 1: the base model unloaded to make room for another and loaded
    again serves its adapters, those of --lora and those loaded at run time."""
    other = tiny_model_dir(tmp_path_factory.mktemp("lora_other"), tiny_dir, seed=99)
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--model", str(other),
            "--served-model-name", "other", "--max-loaded-models", "1", "--engine", "thread",
            "--lora", f"one={adapters['one']}"]  # fmt: skip
    with server_process(args) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = post(s, "/v1/load_lora_adapter", lora_name="two", lora_path=str(adapters["two"]))
        assert r.status_code == 200, r.text
        c.completions.create(model="other", prompt="x", max_tokens=1)  # tiny unloaded
        models = httpx.get(s.base + "/health").json()["models"]
        assert models["tiny"]["state"] == "unloaded" and models["tiny"]["adapters"] == [
            "one",
            "two",
        ]
        for name in ("two", "one", "tiny"):
            check(c, name, refs[name], PROMPTS[0])
        assert "model tiny loaded" in s.log()


def test_a_response_names_its_adapter_and_load(
    server: ServerProcess, adapters: dict[str, Path], refs: dict
) -> None:
    """An adapter reloaded in place under one name (prime-rl's way) is a new policy: each
    response names the adapter and the load of its name beside the base weights' version; a
    response of the base model names none."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "logprobs": 1, "temperature": 0}
    base = post(server, "/v1/completions", model="tiny", **body).json()
    assert "adapter" not in base
    for load, source in ((1, "two"), (2, "three")):
        r = post(server, "/v1/load_lora_adapter", lora_name="policy",
                 lora_path=str(adapters[source]), load_inplace=load > 1)  # fmt: skip
        assert r.status_code == 200, r.text
        got = post(server, "/v1/completions", model="policy", **body).json()
        assert got["adapter"] == {"name": "policy", "load": load}
        assert got["weight_version"] == base["weight_version"]
        gen = post(server, "/inference/v1/generate", model="policy", token_ids=[1, 2, 3],
                   sampling_params={"max_tokens": 2}).json()  # fmt: skip
        assert gen["adapter"] == {"name": "policy", "load": load}
        sg = post(server, "/generate", input_ids=[1, 2, 3], lora_path="policy",
                  sampling_params={"max_new_tokens": 2}).json()  # fmt: skip
        assert sg["meta_info"]["adapter"] == {"name": "policy", "load": load}
    assert post(server, "/v1/unload_lora_adapter", lora_name="policy").status_code == 200
