"""vLLM's token routes through a real server on loopback: `/inference/v1/generate` (ids in, ids
and their entries out), `/v1/chat/completions/tokens` (a chat request whose prompt is the
client's ids), the render routes, `--max-logprobs` (top 100 against a float32 forward), and
flat chat logprobs: every generated token's entry in `logprobs.content` for reasoning and
tool-call answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import encode, reference_logprobs
from tests.helpers.scripted import case_ids
from tests.helpers.scripted_tools import TOOLS as SCRIPTED_TOOLS
from tests.helpers.scripted_tools import write_tools_description
from tests.helpers.server import assert_openai_error, thread_server

PROMPT = "The quick brown fox jumps over the lazy"


@pytest.fixture(scope="module")
def base(tiny: LoadedModel) -> Iterator[str]:
    cfg = EngineConfig(max_num_seqs=16, prefill_chunk=64, max_top_logprobs=100)
    with thread_server(tiny, cfg) as (url, _):
        yield url


def post(base: str, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def check_choice(model: LoadedModel, prompt: list[int], choice: dict[str, Any], k: int) -> None:
    """Ids and entries of one choice against one full float32 forward of the same tokens:
    every token has its entry, in order; the top k are the reference's k best (1e-4)."""
    out = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in out]
    ref = reference_logprobs(model, prompt + out)[len(prompt) - 1 : -1]
    for i, (tok, e) in enumerate(zip(out, content)):
        assert abs(e["logprob"] - ref[i][tok]) < 1e-4, (i, e["logprob"], ref[i][tok])
        assert len(e["top_logprobs"]) == k
        if k:
            got = np.array([t["logprob"] for t in e["top_logprobs"]])
            want = np.sort(ref[i])[::-1][:k]
            np.testing.assert_allclose(got, want, atol=1e-4)
            ids = [int(t["token"].split(":")[1]) for t in e["top_logprobs"]]
            np.testing.assert_allclose(ref[i][ids], got, atol=1e-4)


def generate(base: str, prompt: list[int], **sp: Any) -> Any:
    return post(base, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sp})


def test_generate_matches_a_full_forward(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    body = generate(base, prompt, max_tokens=12, temperature=0.9, seed=3, logprobs=1, n=2)
    assert body["request_id"].startswith("generate-tokens-")
    assert body["weight_version"] == {"counter": 0, "tag": None}
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length") and len(choice["token_ids"]) >= 1
        check_choice(tiny, prompt, choice, 1)
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def test_top_100_against_the_reference(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    body = generate(base, prompt, max_tokens=4, temperature=0, logprobs=100, prompt_logprobs=100)
    check_choice(tiny, prompt, body["choices"][0], 100)
    scored = body["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    ref = reference_logprobs(tiny, prompt)
    for i in range(1, len(prompt)):
        pos = scored[i]
        assert abs(pos[str(prompt[i])]["logprob"] - ref[i - 1][prompt[i]]) < 1e-4
        assert len(pos) in (100, 101)


def test_generate_streamed_equals_not_streamed(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    sp = dict(max_tokens=10, temperature=1.0, seed=11, logprobs=2)
    whole = generate(base, prompt, **sp)["choices"][0]
    ids: list[int] = []
    entries: list[Any] = []
    finish = None
    body = {"token_ids": prompt, "sampling_params": sp, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", base + "/inference/v1/generate", json=body, timeout=60) as r:
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        ids += ch["token_ids"]
        entries += ch["logprobs"]["content"]
        finish = ch["finish_reason"] or finish
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert ids == whole["token_ids"] and entries == whole["logprobs"]["content"]
    assert finish == whole["finish_reason"]


def test_generate_refusals(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    url = base + "/inference/v1/generate"

    def bad(body: dict[str, Any], param: str | None) -> None:
        assert_openai_error(httpx.post(url, json=body, timeout=30), 400, param)

    bad({"token_ids": prompt, "sampling_params": {"tempreature": 1}}, "sampling_params.tempreature")
    bad({"token_ids": [len(tiny.vocab)], "sampling_params": {}}, "token_ids")
    bad({"token_ids": [], "sampling_params": {}}, "token_ids")
    bad({"token_ids": prompt, "sampling_params": {"logprobs": 101}}, "logprobs")
    bad({"token_ids": prompt, "sampling_params": {"logprobs": -1}}, "logprobs")  # vocab > 100
    bad({"token_ids": prompt, "sampling_params": {"max_tokens": 10**6}}, "max_tokens")
    bad({"token_ids": prompt, "features": {"mm_hashes": {}}}, "features")
    r = httpx.post(url, json={"model": "nope", "token_ids": prompt}, timeout=30)
    assert_openai_error(r, 404, "model")


def test_chat_tokens_route_takes_the_clients_ids(base: str, tiny: LoadedModel) -> None:
    """verifiers' token client: /tokenize the messages, then send them with their ids; the
    answer is the chat answer of those ids (here the same ids as the template's)."""
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = post(base, "/tokenize", {"messages": messages})["tokens"]
    common = {"model": tiny.name, "messages": messages, "max_completion_tokens": 8,
              "temperature": 0, "logprobs": True, "return_token_ids": True}  # fmt: skip
    plain = post(base, "/v1/chat/completions", common)
    tokens = post(base, "/v1/chat/completions/tokens", {**common, "tokens": ids})
    assert tokens["prompt_token_ids"] == plain["prompt_token_ids"] == ids
    assert tokens["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    # the second request starts from the first's kept prefix: equal to ~1e-5 (logprobs.md)
    got = [e["logprob"] for e in tokens["choices"][0]["logprobs"]["content"]]
    want = [e["logprob"] for e in plain["choices"][0]["logprobs"]["content"]]
    np.testing.assert_allclose(got, want, atol=1e-5)
    # other ids than the messages': the ids win (the trainer's view of the conversation)
    other = encode(tiny, PROMPT)
    got = post(base, "/v1/chat/completions/tokens", {**common, "tokens": other})
    assert got["prompt_token_ids"] == other
    choice = got["choices"][0]
    lp = {"content": [dict(e, token=f"token_id:{t}") for e, t in
                      zip(choice["logprobs"]["content"], choice["token_ids"])]}  # fmt: skip
    check_choice(tiny, other, {**choice, "logprobs": lp}, 0)
    r = httpx.post(
        base + "/v1/chat/completions/tokens", json={**common, "tokens": [-1]}, timeout=30
    )
    assert_openai_error(r, 400, "tokens")


def test_render_then_generate(base: str, tiny: LoadedModel) -> None:
    """SkyRL: render a chat request, post the rendered body to generate; the same tokens as
    the chat route's."""
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {"model": tiny.name, "messages": messages, "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True}  # fmt: skip
    rendered = post(base, "/v1/chat/completions/render", chat)
    assert rendered["token_ids"] == post(base, "/tokenize", {"messages": messages})["tokens"]
    sp = rendered["sampling_params"]
    assert sp["max_tokens"] == 8 and sp["logprobs"] == 2 and sp["temperature"] == 0
    out = post(base, "/inference/v1/generate", rendered)
    plain = post(base, "/v1/chat/completions", chat)
    assert out["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    many = post(base, "/v1/completions/render",
                {"model": tiny.name, "prompt": [PROMPT, "Hello"], "logprobs": 1})  # fmt: skip
    assert [b["token_ids"] for b in many] == [encode(tiny, p, True) for p in (PROMPT, "Hello")]
    assert all(b["sampling_params"]["max_tokens"] == 16 for b in many)
    r = httpx.post(base + "/v1/chat/completions/render", json={**chat, "top_logprobs": 500})
    assert_openai_error(r, 400, "top_logprobs")


# ---- flat logprobs: reasoning and tool-call answers ------------------------------------------
@pytest.fixture(scope="module")
def thinker(scripted: LoadedModel) -> Iterator[str]:
    with thread_server(scripted, reasoning=True) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LoadedModel]]:
    model = load_model(str(write_tools_description(tmp_path_factory.mktemp("t") / "t.json")))
    with thread_server(model, tool_format="hermes") as (url, _):
        yield url, model


def flat_entries(base: str, body: dict[str, Any], stream: bool) -> tuple[list[int], list[Any]]:
    """(token ids, logprobs.content entries) of one choice, streamed or not."""
    if not stream:
        ch = post(base, "/v1/chat/completions", body)["choices"][0]
        assert set(ch["logprobs"]) == {"content", "refusal"}
        return ch["token_ids"], ch["logprobs"]["content"]
    ids: list[int] = []
    entries: list[Any] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                ids += ch.get("token_ids") or []
                if ch["logprobs"]:
                    entries += ch["logprobs"]["content"]
    return ids, entries


@pytest.mark.parametrize("stream", [False, True])
def test_flat_logprobs_with_reasoning(thinker: str, scripted: LoadedModel, stream: bool) -> None:
    body = {"model": "scripted-thinker", "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "messages": [{"role": "user", "content": "Case: special"}],
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    ids, entries = flat_entries(thinker, body, stream)
    want, reasoning = case_ids(scripted, "special")
    assert reasoning > 0 and ids == want
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
    # asked for sections, they come back (the request's field beats the default)
    ch = post(thinker, "/v1/chat/completions", {**body, "flat_logprobs": False})["choices"][0]
    assert len(ch["logprobs"]["reasoning_content"]) == reasoning


def test_flat_logprobs_with_a_tool_call(tooled: tuple[str, LoadedModel]) -> None:
    base, model = tooled
    body = {"model": model.name, "temperature": 0, "logprobs": True, "tools": SCRIPTED_TOOLS,
            "messages": [{"role": "user", "content": "Case: weather"}],
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    for stream in (False, True):
        ids, entries = flat_entries(base, body, stream)
        assert ids and [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
    ch = post(base, "/v1/chat/completions", body)["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["tool_calls"]
    # without return_token_ids the sections stay apart (unless asked flat)
    plain = {k: v for k, v in body.items() if k != "return_token_ids"}
    lp = post(base, "/v1/chat/completions", plain)["choices"][0]["logprobs"]
    assert lp["tool_calls"] and len(lp["content"]) + len(lp["tool_calls"]) == len(ids)
    flat = post(base, "/v1/chat/completions", {**plain, "flat_logprobs": True})
    assert len(flat["choices"][0]["logprobs"]["content"]) == len(ids)
