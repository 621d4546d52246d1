"""Every configurable limit gives a clear OpenAI-shaped error naming what was over it. The field
limits run over every POST route the server's OpenAPI schema lists, so new endpoints are covered."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.lora import make_adapter
from tests.helpers.server import (
    TINY_NAME,
    assert_api_error,
    assert_openai_error,
    thread_server,
    wait_idle,
)
from tests.reliability.schema import Route, accepts_type, minimal_body, routes

LIMITS = Limits(
    max_body_bytes=1 << 20,
    max_queued=1,
    max_output_tokens=8,
    max_n=2,
    max_stop=4,
    max_stop_chars=8,
    max_stop_token_ids=4,
    max_logprob_token_ids=4,
)
CFG = EngineConfig(max_num_seqs=1, prefill_chunk=64)  # with max_queued=1: two in flight, then 429

# field -> a value just over LIMITS (or over the model: vocabulary 49152, 256 top logprobs)
OVER: dict[str, Any] = {
    "n": 3,
    "max_tokens": 9,
    "max_completion_tokens": 9,
    "top_logprobs": 257,
    "logprobs": 257,  # only where the schema takes an integer (completions), not chat's boolean
    "prompt_logprobs": 257,
    "stop": ["a", "b", "c", "d", "e"],
    "stop_token_ids": [1, 2, 3, 4, 5],
    "logprob_token_ids": [1, 2, 3, 4, 5],
}
# Routes whose schema cannot say what their smallest accepted body is ("one of prompt and
# messages"): the fields to add to the schema's required ones.
EXTRA_MINIMAL: dict[str, dict[str, Any]] = {
    "/tokenize": {"prompt": "hi"},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    "/api/chat": {"messages": [{"role": "user", "content": "hi"}], "stream": False},
    "/api/generate": {"stream": False},
    "/score": {"text_1": "hi", "text_2": "hi"},  # one of its pairs of sides (vLLM's names)
    "/v1/score": {"text_1": "hi", "text_2": "hi"},
}
# field -> (value, param): one bad element inside an otherwise allowed value
BAD_ELEMENT: dict[str, tuple[Any, str]] = {
    "stop": (["ok", "123456789"], "stop[1]"),
    "stop_token_ids": ([1, 49152], "stop_token_ids"),
    "logprob_token_ids": ([-1], "logprob_token_ids"),
}


@pytest.fixture(scope="module")
def limited(tiny_served: LoadedModel) -> Iterator[str]:
    with thread_server(tiny_served, CFG, LIMITS) as (base, _):
        yield base


@pytest.fixture(scope="module")
def unbounded_output(tiny_served: LoadedModel) -> Iterator[str]:
    """The same limits but output's: a request that names no limit runs to the context's end
    (--max-output-tokens bounds those too), so a stream holds its row while others arrive."""
    with thread_server(tiny_served, CFG, replace(LIMITS, max_output_tokens=1 << 20)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def short_limited(tiny_served: LoadedModel) -> Iterator[str]:
    """The same limits over a 160-token context (the longest smallest prompt: /rerank's, 84
    tokens): a route's smallest accepted body names no token limit, and a server that did not
    hold it to --max-output-tokens would generate to the context's end (~9 s a route at the
    tiny model's 2,048 tokens)."""
    with thread_server(replace(tiny_served, max_model_len=160), CFG, LIMITS) as (base, _):
        yield base


@pytest.fixture(scope="module")
def post_routes(limited: str) -> list[Route]:
    # With a JSON body: an upload is multipart (tests/integration/test_batches.py limits it).
    found = [r for r in routes(limited) if r.method == "POST" and r.body_schema is not None]
    assert any(r.path == "/v1/chat/completions" for r in found)
    return found


def cases(route: Route) -> Iterator[tuple[str, Any, str]]:
    props, root = route.properties, route.body_schema or {}
    for field, value in OVER.items():
        if field in props and (field != "logprobs" or accepts_type(props[field], root, "integer")):
            yield field, value, field
    for field, (value, param) in BAD_ELEMENT.items():
        if field in props:
            yield field, value, param


def batch_input(base: str) -> str:
    """An uploaded batch file of one request (what a batch's smallest accepted body names)."""
    body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 1}
    row = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    files = {"file": ("in.jsonl", json.dumps(row).encode())}
    r = httpx.post(base + "/v1/files", data={"purpose": "batch"}, files=files, timeout=30)
    return str(r.json()["id"])


# Their limits and bad fields on an embedding model: tests/integration/test_embeddings.py.
EMBEDDING_ROUTES = frozenset(["/v1/embeddings", "/api/embed", "/api/embeddings"])


def test_field_limits_on_every_route(
    short_limited: str, post_routes: list[Route], tiny_served: LoadedModel, tmp_path: Path
) -> None:
    limited = short_limited
    checked = []
    # The weights route's smallest accepted body names weights: the served model's own; the
    # LoRA routes', an adapter of it, loaded, then unloaded (so the unloading route goes last).
    adapter = make_adapter(tmp_path / "adapter", tiny_served.path, seed=3)
    extra = {
        **EXTRA_MINIMAL,
        "/update_weights_from_disk": {"model_path": str(tiny_served.path)},
        "/update_weights": {"weight_dir": str(tiny_served.path)},
        "/v1/load_lora_adapter": {"lora_name": "limits", "lora_path": str(adapter)},
        "/v1/unload_lora_adapter": {"lora_name": "limits"},
        "/v1/batches": {
            "input_file_id": batch_input(limited),
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    }
    for route in sorted(post_routes, key=lambda r: r.path == "/v1/unload_lora_adapter"):
        base = {**minimal_body(route, TINY_NAME), **extra.get(route.path, {})}
        if route.path in EMBEDDING_ROUTES:  # a generative model serves none: a 400 that says so
            no = httpx.post(limited + route.path, json=base, timeout=60)
            assert no.status_code == 400 and "does not serve embeddings" in no.text, no.text
            continue
        ok = httpx.post(limited + route.path, json=base, timeout=60)
        assert ok.status_code == 200, (route.path, ok.text)
        for field, value, param in cases(route):
            r = httpx.post(limited + route.path, json={**base, field: value}, timeout=60)
            assert_api_error(r, 400, param, route.path)
            checked.append((route.path, field))
    chat = {f for p, f in checked if p == "/v1/chat/completions"}
    assert {"n", "max_tokens", "max_completion_tokens", "top_logprobs", "stop"} <= chat


HI = [{"role": "user", "content": "hi"}]
# route -> (a body that sends no output limit, the output tokens and why it ended, from the answer)
UNBOUNDED: dict[str, tuple[dict[str, Any], Any]] = {
    "/v1/chat/completions": (
        {"messages": HI},
        lambda b: (b["usage"]["completion_tokens"], b["choices"][0]["finish_reason"]),
    ),
    "/v1/completions": (  # OpenAI's default 16, over the flag
        {"prompt": "hi"},
        lambda b: (b["usage"]["completion_tokens"], b["choices"][0]["finish_reason"]),
    ),
    "/v1/responses": (
        {"input": "hi"},
        lambda b: (b["usage"]["output_tokens"], b["incomplete_details"]["reason"]),
    ),
    "/api/chat": (
        {"messages": HI, "stream": False, "options": {"num_predict": -1}},
        lambda b: (b["eval_count"], b["done_reason"]),
    ),
    "/api/generate": (
        {"prompt": "hi", "stream": False},
        lambda b: (b["eval_count"], b["done_reason"]),
    ),
    "/inference/v1/generate": (
        {"token_ids": [1, 2, 3], "sampling_params": {}},
        lambda b: (len(b["choices"][0]["token_ids"]), b["choices"][0]["finish_reason"]),
    ),
    "/generate": (  # SGLang's default 128, over the flag
        {"input_ids": [1, 2, 3], "sampling_params": {}},
        lambda b: (len(b["output_ids"]), b["meta_info"]["finish_reason"]["type"]),
    ),
}
ENDED = {"length", "max_output_tokens"}


def test_a_request_without_an_output_limit_stops_at_max_output_tokens(
    short_limited: str,
) -> None:
    """--max-output-tokens (8) bounds what a request that sends no output limit generates (vLLM
    lets it run to the context's end, ~150 tokens here; a route's own default, over the flag,
    is no 400 either); a larger value sent stays a 400 on every route."""
    for path, (body, read) in UNBOUNDED.items():
        r = httpx.post(short_limited + path, json={"model": TINY_NAME, **body}, timeout=120)
        assert r.status_code == 200, (path, r.text)
        tokens, why = read(r.json())
        assert tokens == LIMITS.max_output_tokens and why in ENDED, (path, r.json())
    over = {
        "/v1/responses": ({"input": "hi", "max_output_tokens": 9}, "max_output_tokens"),
        "/api/chat": ({"messages": HI, "stream": False, "options": {"num_predict": 9}},
                      "options.num_predict"),
        "/generate": ({"input_ids": [1], "sampling_params": {"max_new_tokens": 9}},
                      "max_new_tokens"),
        "/v1/messages": ({"messages": HI, "max_tokens": 9}, "max_tokens"),
    }  # fmt: skip
    for path, (body, param) in over.items():
        r = httpx.post(short_limited + path, json={"model": TINY_NAME, **body}, timeout=60)
        assert_api_error(r, 400, param, path)


def test_the_engine_configs_context_bounds_the_routes(tiny_served: LoadedModel) -> None:
    """The context the routes check against is the engine config's (--max-model-len) where it
    is below the model's, whoever loaded the model."""
    with thread_server(tiny_served, EngineConfig(max_model_len=64), LIMITS) as (base, _):
        card = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
        assert card["max_model_len"] == 64, card
        words = {"model": TINY_NAME, "prompt": " ".join(["word"] * 70), "max_tokens": 1}
        r = httpx.post(base + "/v1/completions", json=words, timeout=60)
        assert assert_openai_error(r, 400, "prompt")["code"] == "context_length_exceeded"
        short = {"model": TINY_NAME, "prompt": " ".join(["word"] * 60), "max_tokens": 8}
        r = httpx.post(base + "/v1/completions", json=short, timeout=60)
        assert assert_openai_error(r, 400, "max_tokens")["code"] == "context_length_exceeded"


def test_openapi_says_400_in_openai_shape(limited: str, post_routes: list[Route]) -> None:
    """/openapi.json advertises what the server answers: no FastAPI 422 anywhere, and every route
    that takes a body a 400 whose schema is the error shape every rejection has."""
    spec = httpx.get(limited + "/openapi.json", timeout=30).json()
    assert "HTTPValidationError" not in str(spec)
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
            if "requestBody" in op:
                schema = op["responses"]["400"]["content"]["application/json"]["schema"]
                shape = (
                    "AnthropicErrorResponse"
                    if path.startswith("/v1/messages")
                    else "OllamaErrorResponse"
                    if path.startswith("/api/")
                    else "ErrorResponse"
                )
                assert schema == {"$ref": f"#/components/schemas/{shape}"}, path
    schemas = spec["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    detail = schemas["ErrorDetail"]
    assert detail["required"] == ["message", "type", "param", "code"]
    for route in post_routes:  # the advertised shape is the one sent
        body = {**minimal_body(route, TINY_NAME), **EXTRA_MINIMAL.get(route.path, {})}
        r = httpx.post(limited + route.path, json={**body, "model": []}, timeout=60)
        if route.path.startswith(("/v1/messages", "/api/")):  # their own shapes
            assert_api_error(r, 400, "model" if "model" in route.properties else None, route.path)
            continue
        if "model" in route.properties:
            err = assert_openai_error(r, 400, "model")
        else:  # the LoRA routes take no model: refused all the same, in the same shape
            assert r.status_code == 400, r.text
            err = r.json()["error"]
        assert set(err) == set(detail["properties"])
    assert {r.path for r in post_routes} >= {"/v1/chat/completions", "/v1/completions"}


def test_limits_accept_values_at_the_limit(limited: str) -> None:
    body = {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stop": ["12345678", "b", "c", "d"],
        "stop_token_ids": [1, 2, 3, 49151],
        "logprobs": True,
        "top_logprobs": 256,  # the default --max-logprobs
    }
    r = httpx.post(limited + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 256


def test_prompt_over_the_context_window(limited: str) -> None:
    url = limited + "/v1/chat/completions"
    long = " ".join(["word"] * 2100)  # the tiny model's context is 2048 tokens
    r = httpx.post(url, json={"model": TINY_NAME, "messages": [{"role": "user", "content": long}]})
    assert assert_openai_error(r, 400, "messages")["code"] == "context_length_exceeded"


def test_far_too_long_text_is_refused_before_tokenizing(limited: str) -> None:
    text = "x" * (2 * 81 * 2048 + 1)  # over twice the context in the longest tokens
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(limited + "/v1/chat/completions", json=body, timeout=60)
    err = assert_openai_error(r, 400, "messages")
    assert err["code"] == "context_length_exceeded" and "far longer" in err["message"]


def test_body_size(limited: str) -> None:
    url = limited + "/v1/chat/completions"
    big = b'{"model": "tiny", "messages": [], "pad": "' + b"x" * (1 << 20) + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert assert_openai_error(r, 413, None)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no content-length: counted while read
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(url, content=chunked(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413, None)
    assert httpx.get(limited + "/health").status_code == 200


def test_overload_gets_429_with_retry_after(unbounded_output: str) -> None:
    url = unbounded_output + "/v1/chat/completions"
    # No max_tokens on a server without an output bound: the whole context, so both holders
    # are still generating, one running and one queued, when the third request arrives.
    long = {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": "go"}],
        "ignore_eos": True,
        "stream": True,
    }
    started = threading.Barrier(3)
    release = threading.Event()

    # The holders run to the context's end (no max_tokens, EOS ignored): a short stream could
    # finish and leave the server before the third request arrives.
    endless = {k: v for k, v in long.items() if k != "max_tokens"} | {"ignore_eos": True}

    def hold() -> None:
        with httpx.stream("POST", url, json=endless, timeout=60) as r:
            assert r.status_code == 200
            started.wait()
            release.wait(60)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    started.wait(60)
    try:
        r = httpx.post(url, json={**long, "stream": False, "max_tokens": 4}, timeout=60)
        err = assert_openai_error(r, 429, None)
        assert err["code"] == "server_busy" and r.headers["retry-after"] == "1"
        assert (
            httpx.get(unbounded_output + "/v1/models").status_code == 200
        )  # reads are never queued
    finally:
        release.set()
        for t in holders:
            t.join(60)
    wait_idle(unbounded_output)
    r = httpx.post(url, json={**long, "stream": False, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_raised_limits_are_the_only_bound(tiny_served: LoadedModel) -> None:
    """`--max-n` and `--max-logprob-token-ids` above their defaults (16, 128) are what the
    server takes: no constant elsewhere refuses a value within them."""
    raised = Limits(max_n=24, max_logprob_token_ids=160)
    with thread_server(tiny_served, CFG, raised) as (base, _):
        body = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        r = httpx.post(base + "/v1/completions", json={**body, "n": 24}, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == 24
        ids = list(range(100, 260))
        scored = {**body, "logprobs": 1, "logprob_token_ids": ids}
        r = httpx.post(base + "/v1/completions", json=scored, timeout=120)
        assert r.status_code == 200, r.text
        [top] = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert len(top) >= 1
        over = httpx.post(base + "/v1/completions", json={**body, "n": 25}, timeout=30)
        assert_openai_error(over, 400, "n")
        wait_idle(base)


def test_a_context_past_the_memory_is_refused_at_admission(
    tiny_served: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys and values of prompt + max_tokens against the memory the weights leave (the
    tiny model's 2 layers x 2 KV heads x 16 x 2 x 4 bytes = 512 a token, from its config): past
    it, a 400 in OpenAI's shape with the numbers, naming the prompt or max_tokens; within it,
    the request runs."""
    from omlx_logprobs.api.core import bounds
    from omlx_logprobs.models.footprint import kv_bytes_per_token

    per_token = kv_bytes_per_token(tiny_served.path)
    assert per_token == 2 * 2 * 2 * 16 * 4
    monkeypatch.setattr(bounds, "kv_memory", lambda model: (per_token, 300 * per_token))
    with thread_server(tiny_served) as (base, _):
        url = base + "/v1/completions"
        body = {"model": TINY_NAME, "prompt": [5] * 100, "max_tokens": 150}
        assert httpx.post(url, json=body).status_code == 200
        r = httpx.post(url, json={**body, "max_tokens": 250})
        err = assert_openai_error(r, 400, "max_tokens")
        assert "100 prompt tokens + 250 max_tokens" in err["message"] and "MiB" in err["message"]
        r = httpx.post(url, json={**body, "prompt": [5] * 400, "max_tokens": 1})
        assert assert_openai_error(r, 400, "prompt")["code"] == "context_length_exceeded"
