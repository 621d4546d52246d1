"""Routed experts through a real server on loopback (api/core/routed_experts.py): a tiny seeded
random qwen3_moe answers `return_routed_experts` on chat completions (the `openai` client's
extra_body), completions (streamed: on the final chunk), vLLM's /inference/v1/generate and
SGLang's /generate with the routing its router picks for the tokens alone; a routing sent back
on /inference/v1/generate is replayed; a dense model, a model split over processes and a routing
of the wrong shape are 400s."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.api.core.bounds import model_bounds
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.routed_experts import with_routing
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import SamplingParams
from tests.engine.test_families import built, prompt
from tests.engine.test_routed_experts import forward, sorted_ids
from tests.helpers.server import assert_openai_error, thread_server


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LoadedModel:
    return built("qwen3_moe", tmp_path_factory, tokenizer_dir)


@pytest.fixture(scope="module")
def base(moe: LoadedModel) -> Iterator[str]:
    with thread_server(moe) as (url, _):
        yield url


def npy(value: str) -> np.ndarray:
    """A `routed_experts` string as vLLM's clients read it."""
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


def test_chat_completions_return_the_routers_choice(base: str, moe: LoadedModel) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    r = client.chat.completions.create(
        model=moe.name,
        messages=[{"role": "user", "content": "Which experts?"}],
        max_tokens=5,
        temperature=0,
        extra_body={"return_routed_experts": True, "return_token_ids": True, "ignore_eos": True},
    )
    body = r.model_dump()
    prompt_ids, ids = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    routed = npy(body["choices"][0]["routed_experts"])
    assert routed.dtype == np.int16 and routed.shape == (len(prompt_ids) + 4, 2, 2)
    picked, _ = forward(moe, prompt_ids + ids[:-1])
    np.testing.assert_array_equal(sorted_ids(routed), picked)


def test_a_streamed_completion_carries_them_on_its_final_chunk(base: str, moe: LoadedModel) -> None:
    body = {"model": moe.name, "prompt": "Route these tokens", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "return_routed_experts": True,
            "return_token_ids": True}  # fmt: skip
    whole = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    chunks = []
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    carrying = [c for c in chunks if "routed_experts" in c["choices"][0]]
    assert len(carrying) == 1 and carrying[0] is chunks[-1]
    assert carrying[0]["choices"][0]["finish_reason"] == "length"
    choice = whole["choices"][0]
    routed = npy(choice["routed_experts"])
    np.testing.assert_array_equal(npy(carrying[0]["choices"][0]["routed_experts"]), routed)
    picked, _ = forward(moe, choice["prompt_token_ids"] + choice["token_ids"][:-1])
    np.testing.assert_array_equal(sorted_ids(routed), picked)


def test_generate_replays_a_routing_sent_back(base: str, moe: LoadedModel) -> None:
    """A routing other than the router's (each id moved by one) on the prompt: the prompt's
    entries are those of a forward forced to it, and it comes back as sent."""
    ids = prompt(9, 12)
    natural, lp_natural = forward(moe, ids)
    given = np.stack([(natural[..., 0] + 1) % 4, (natural[..., 1] + 1) % 4], axis=-1)
    given = np.where(given[..., :1] == given[..., 1:], (given + [0, 1]) % 4, given)
    given = given.astype(np.int16)
    _, lp_forced = forward(moe, ids, given)
    sent = base64.b64encode(_npy_bytes(given)).decode()
    sampling = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    body = {"token_ids": ids, "return_routed_experts": True, "routed_experts": sent,
            "sampling_params": sampling}  # fmt: skip
    r = httpx.post(base + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    routed = npy(out["choices"][0]["routed_experts"])
    np.testing.assert_array_equal(routed, given)
    scored = [next(iter(e.values()))["logprob"] for e in out["prompt_logprobs"][1:]]
    want = lp_forced[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(scored, want, atol=2e-5)
    assert np.abs(lp_natural[np.arange(len(ids) - 1), ids[1:]] - want).max() > 1e-3
    # As nested lists too
    body["routed_experts"] = given.tolist()
    again = httpx.post(base + "/inference/v1/generate", json=body, timeout=60).json()
    np.testing.assert_array_equal(npy(again["choices"][0]["routed_experts"]), given)


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_sglang_generate_returns_them_in_meta_info(base: str, moe: LoadedModel) -> None:
    ids = prompt(10, 9)
    body: dict[str, Any] = {"input_ids": ids, "return_routed_experts": True,
                            "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                "ignore_eos": True}}  # fmt: skip
    out = httpx.post(base + "/generate", json=body, timeout=60).json()
    flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), "<i4")
    routed = flat.reshape(len(ids) + 2, 2, 2)
    picked, _ = forward(moe, ids + out["output_ids"][:-1])
    np.testing.assert_array_equal(sorted_ids(routed), picked)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"routed_experts": [[[0, 1]]] * 3}, "routed_experts"),  # one MoE layer of two
        ({"routed_experts": [[[0, 4], [0, 1]]]}, "routed_experts"),  # an expert past the last
        ({"routed_experts": [[[1, 1], [0, 1]]]}, "routed_experts"),  # one expert twice
        ({"routed_experts": "not base64 of a .npy"}, "routed_experts"),
        ({"routed_experts": [[[0, 1], [2, 3]]] * 99}, "routed_experts"),  # past the prompt
    ],
)
def test_a_routing_of_the_wrong_shape_is_a_400(
    base: str, moe: LoadedModel, extra: dict[str, Any], param: str
) -> None:
    body = {"model": moe.name, "prompt": "Route", "max_tokens": 1, **extra}
    assert_openai_error(httpx.post(base + "/v1/completions", json=body, timeout=60), 400, param)


def test_a_dense_model_refuses_them(tiny: LoadedModel) -> None:
    with thread_server(tiny) as (url, _):
        for field, value in (("return_routed_experts", True), ("routed_experts", [[[0]]])):
            body = {"model": tiny.name, "messages": [{"role": "user", "content": "hi"}],
                    field: value}  # fmt: skip
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert_openai_error(r, 400, field)
            r = httpx.post(url + "/inference/v1/generate",
                           json={"token_ids": [1, 2], field: value}, timeout=60)  # fmt: skip
            assert_openai_error(r, 400, field)


def test_the_server_flag_makes_every_request_ask(moe: LoadedModel, tiny: LoadedModel) -> None:
    """--enable-return-routed-experts (vLLM's): a request that does not ask gets them on a
    MoE model; a dense model answers as before."""
    cfg = EngineConfig(max_num_seqs=8, prefill_chunk=64, return_routed_experts=True)
    ids = prompt(13, 6)
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 2, "temperature": 0}}
    with thread_server(moe, cfg) as (url, _):
        out = httpx.post(url + "/inference/v1/generate", json=body, timeout=60).json()
    choice = out["choices"][0]
    routed = npy(choice["routed_experts"])
    picked, _ = forward(moe, ids + choice["token_ids"][:-1])
    np.testing.assert_array_equal(sorted_ids(routed), picked)
    with thread_server(tiny, cfg) as (url, _):
        r = httpx.post(url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200 and "routed_experts" not in r.json()["choices"][0]


def test_a_model_split_over_processes_refuses_them(moe: LoadedModel) -> None:
    """Rank 0 of a group (`cfg.parallel` set) records no routing: asking or replaying is a 400
    that says why, never a replay its other ranks would ignore."""
    served = SimpleNamespace(
        cfg=EngineConfig(parallel="tensor"),
        checks=RequestLimits(Limits(), model_bounds(moe, 20)),
        model=moe,
    )
    params = SamplingParams(max_tokens=1)
    assert with_routing(SimpleNamespace(), served, 4, params) == (params, None)
    for field, value in (("return_routed_experts", True), ("routed_experts", [[[0]]])):
        with pytest.raises(APIError, match="split over processes") as e:
            with_routing(SimpleNamespace(**{field: value}), served, 4, params)
        assert e.value.param == field
