"""Fuzzing every route the server's own OpenAPI schema lists, plus hand-written hostile bodies.

Properties, for every request: no 5xx, no dropped connection, every rejection in OpenAI's error
shape, every 400 for a JSON object naming a `param`, every 200 strict JSON (no NaN) and every
stream ending in `[DONE]`. The fast run is part of `make test`; `make fuzz` runs the long one
(FUZZ_EXAMPLES per route and strategy, default 2000).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.server import TINY_NAME, thread_server, wait_idle
from tests.reliability.schema import Route, from_schema, json_values, minimal_body, routes
from tests.reliability.test_limits import EXTRA_MINIMAL

CONTEXT = 96  # a short context keeps every generated answer short
# `make test`'s run: 20 per route and strategy (26 s at 40 on a quiet 2-core box); `make fuzz`
# runs FUZZ_EXAMPLES, 2,000 by default.
FAST_EXAMPLES = 20


@pytest.fixture(scope="module")
def fuzz_server(tiny_served: LoadedModel) -> Iterator[str]:
    model = replace(tiny_served, max_model_len=CONTEXT)
    with thread_server(model, EngineConfig(max_num_seqs=16, prefill_chunk=32)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def http(fuzz_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server, timeout=120) as c:
        yield c


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a response")

    return json.loads(text, parse_constant=refuse)


def send(http: httpx.Client, route: Route, raw: bytes, ctype: str = "application/json") -> int:
    """One request; assert every property; return the status. Each API has its own framing
    and error shape: OpenAI's (SSE ending in [DONE], named events for Responses), Anthropic's
    (`/v1/messages`: named events, `{"type": "error", "error"}`) and Ollama's (`/api/`: NDJSON,
    `{"error": message}`)."""
    with http.stream(route.method, route.path, content=raw, headers={"content-type": ctype}) as r:
        body = r.read().decode("utf-8")  # a dropped connection raises here
    assert r.status_code < 500, (r.status_code, body[:500], raw[:300])
    if r.status_code == 200:
        kind = r.headers["content-type"]
        if kind.startswith("text/event-stream"):
            events = [ln[6:] for ln in body.split("\n") if ln.startswith("data: ")]
            named = "\nevent: " in "\n" + body  # Responses and Anthropic: no [DONE]
            assert named or events[-1] == "[DONE]", body[-300:]
            for e in events if named else events[:-1]:
                _strict(e)
        elif kind.startswith("application/x-ndjson"):
            for line in body.splitlines():
                _strict(line)
        else:
            _strict(body)
        return 200
    payload = _strict(body)
    if route.path.startswith("/api/"):
        assert set(payload) == {"error"} and isinstance(payload["error"], str), body
        return r.status_code
    if route.path.startswith("/v1/messages"):
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, body
        return r.status_code
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    if r.status_code == 400 and ctype == "application/json" and _is_object(raw):
        assert isinstance(err["param"], str) and err["param"], (body, raw[:300])
    return r.status_code


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def dumps(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def post_routes(base: str) -> list[Route]:
    return [r for r in routes(base) if r.method == "POST" and r.body_schema is not None]


def run_fuzz(http: httpx.Client, base: str, examples: int, derandomize: bool) -> Counter[int]:
    """Schema-valid, mutated and arbitrary bodies for every POST route; a count per status."""
    seen: Counter[int] = Counter()
    config = settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    for route in post_routes(base):
        for strategy in fuzz_route(http, route, seen):
            config(strategy)()
    assert wait_idle(base)["cached_sequences"] == 0
    return seen


def fuzz_route(http: httpx.Client, route: Route, seen: Counter[int]) -> list[Callable[[], None]]:
    assert route.body_schema is not None
    valid = from_schema(route.body_schema, route.body_schema).map(
        lambda b: {**b, "model": TINY_NAME} if "model" in b else b
    )

    @given(body=valid, keep_model=st.booleans())
    def schema_valid(body: dict[str, Any], keep_model: bool) -> None:
        if not keep_model and "model" in body:
            body = {**body, "model": "x" + str(body.get("model"))}
        seen[send(http, route, dumps(body))] += 1

    @given(
        body=valid,
        key=st.sampled_from(sorted(route.properties)) | st.text(max_size=8),
        value=json_values(),
        drop=st.booleans(),
    )
    def mutated(body: dict[str, Any], key: str, value: Any, drop: bool) -> None:
        body = dict(body)
        if drop:
            body.pop(key, None)
        else:
            body[key] = value
        seen[send(http, route, dumps(body))] += 1

    @given(raw=st.binary(max_size=64) | json_values().map(dumps))
    def arbitrary(raw: bytes) -> None:
        seen[send(http, route, raw)] += 1

    return [schema_valid, mutated, arbitrary]


def test_fuzz_fast(http: httpx.Client, fuzz_server: str) -> None:
    seen = run_fuzz(http, fuzz_server, FAST_EXAMPLES, derandomize=True)
    assert seen[200] > 0 and seen[400] > 0, seen


@pytest.mark.slow
def test_fuzz_long(http: httpx.Client, fuzz_server: str) -> None:
    examples = int(os.environ.get("FUZZ_EXAMPLES", "2000"))
    seen = run_fuzz(http, fuzz_server, examples, derandomize=False)
    print(f"\nfuzz: {examples} examples per route and strategy; statuses {dict(seen)}")


# ---- hand-written hostile bodies --------------------------------------------------------------
def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


GENERIC: list[tuple[str, bytes]] = [  # for every POST route
    ("empty", b""),
    ("null", b"null"),
    ("array", b"[]"),
    ("string", b'"x"'),
    ("number", b"1"),
    ("NaN", b"NaN"),
    ("truncated", b'{"model": "tiny", "mess'),
    ("invalid utf-8", b'{"model": "tiny\xff\xfe", "x": "\xc3"}'),
    ("bom", b'\xef\xbb\xbf{"model": "tiny"}'),
    ("nested 100k", nested(100_000)),
    ("object nest", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    ("empty object", b"{}"),
    ("7 MB string", b'{"model": "tiny", "x": "' + b"a" * 7_000_000 + b'"}'),
]


@pytest.mark.parametrize("name, raw", GENERIC, ids=[n for n, _ in GENERIC])
def test_hostile_raw_bodies(http: httpx.Client, fuzz_server: str, name: str, raw: bytes) -> None:
    for route in post_routes(fuzz_server):
        # JSON may start with a byte order mark (RFC 8259 lets a parser ignore it): a route for
        # which `{"model": "tiny"}` alone is a whole request (Ollama's generate) answers it.
        ok = name == "bom" and send(http, route, b'{"model": "tiny"}') == 200
        assert send(http, route, raw) in ((200,) if ok else (400, 404)), name
        assert send(http, route, raw, ctype="text/plain") in (400, 404), name


def hostile_values(prop: dict[str, Any]) -> list[Any]:
    """Wrong types and out-of-range numbers for any field: NaN and +-Infinity, huge integers,
    huge and nested values, lone surrogates."""
    return [
        float("nan"),
        float("inf"),
        -float("inf"),
        1e308,
        -(2**70),
        2**70,
        10**400,
        1.5,
        True,
        "1",
        "\ud800",
        "x" * 100_000,
        [],
        [None],
        {},
        {"a": [{"b": [[[[[[]]]]]]}]},
        json.loads(nested(200)),
    ]


SHORT: dict[str, Any] = {
    "max_tokens": 2,
    "max_output_tokens": 16,  # the Responses API's least
    "options": {"num_predict": 2},  # Ollama's
}


def test_hostile_values_in_every_field(http: httpx.Client, fuzz_server: str) -> None:
    """Sent eight at a time (the client is thread-safe): the bodies the server answers with a
    generation then share its batch, as a client's would."""
    cases = []
    for route in post_routes(fuzz_server):
        base = {**minimal_body(route, TINY_NAME), **EXTRA_MINIMAL.get(route.path, {})}
        # Short answers (what is checked is each field's value, not the generation), where the
        # route has the field; the field under test replaces it.
        base |= {k: v for k, v in SHORT.items() if k in route.properties and k not in base}
        for field, prop in route.properties.items():
            cases += [(route, field, {**base, field: v}) for v in hostile_values(prop)]

    def one(case: tuple[Route, str, dict[str, Any]]) -> None:
        route, field, body = case
        status = send(http, route, dumps(body))
        assert status in (200, 400, 404), (route.path, field, body[field])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, cases))


CHAT: dict[str, Any] = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}]}
CHAT_CASES: list[tuple[dict[str, Any], int, str | None]] = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, 400, None),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "extra": "\udfff"}]}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}] * 20_000}, 400, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 5000}]},
        400,
        None,
    ),
    ({"stop": "\ud800"}, 400, "stop"),
    ({"stop": ["ok", "\udc00"]}, 400, "stop[1]"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ({"logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"1e3": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, 400, "logit_bias.5"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"top_k": 10**12, "temperature": 1, "max_tokens": 2}, 200, None),
    ({"seed": 2**200, "temperature": 1, "max_tokens": 2}, 200, None),
    ({"seed": -(2**200), "temperature": 1, "max_tokens": 2}, 200, None),
    ({"max_tokens": 2**70}, 400, "max_tokens"),
    ({"temperature": float("nan")}, 400, "temperature"),
    ({"top_p": float("inf")}, 400, "top_p"),
    ({"repetition_penalty": 1e-40}, 400, "repetition_penalty"),
    ({"temperature": 1e-45, "max_tokens": 2}, 200, None),
    ({"chat_template_kwargs": {"messages": "x"}}, 400, "chat_template_kwargs"),
]


@pytest.mark.parametrize("extra, status, param", CHAT_CASES)
def test_hostile_chat_requests(
    http: httpx.Client, extra: dict[str, Any], status: int, param: str | None
) -> None:
    raw = dumps({**CHAT, **extra})
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:500]
    if status != 200:
        err = r.json()["error"]
        assert err["param"] and (param is None or err["param"] == param), err
