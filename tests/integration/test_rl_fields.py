"""The fields RL frameworks send with each request, through the real server and the real `openai`
client (`extra_body`, as vLLM's clients send them) and vLLM's /inference/v1/generate:
`cache_salt` (a prefix-cache namespace: a prompt sent again hits the cache under its own salt
only, as `usage.prompt_tokens_details.cached_tokens` says) and `priority` (accepted; its order
is tested on the engine, tests/engine/test_priority.py); each bounded, else a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import encode
from tests.helpers.server import assert_openai_error, thread_server


@pytest.fixture(scope="module")
def base(tiny: LoadedModel) -> Iterator[str]:
    cfg = EngineConfig(max_num_seqs=8, prefill_chunk=64, prefix_cache_mib=64)
    with thread_server(tiny, cfg) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def system(topic: str) -> str:
    return f"You are the {topic} assistant of a long rollout; answer in one line. " * 3


def test_chat_hits_the_cache_under_its_own_salt_only(
    client: openai.OpenAI, tiny: LoadedModel
) -> None:
    messages: Any = [
        {"role": "system", "content": system("chat")},
        {"role": "user", "content": "Name a colour."},
    ]

    def cached(salt: str | None, priority: int = 0) -> tuple[int, int]:
        extra: dict[str, Any] = {"priority": priority}
        if salt is not None:
            extra["cache_salt"] = salt
        r = client.chat.completions.create(
            model=tiny.name, messages=messages, max_tokens=4, temperature=0, extra_body=extra
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0, r.usage.prompt_tokens

    first, n = cached("run-1/group-a", priority=-3)
    assert first == 0
    assert cached("run-1/group-a", priority=7) == (n - 1, n)  # all but the last token
    assert cached("run-1/group-b")[0] == 0  # another salt
    assert cached(None)[0] == 0  # no salt: the default namespace, apart from every salt
    assert cached(None)[0] == n - 1
    assert cached("run-1/group-b")[0] == n - 1


def test_completions_and_generate_take_the_salt(
    client: openai.OpenAI, base: str, tiny: LoadedModel
) -> None:
    prompt = system("completions") + "Q: name a colour.\nA:"
    got = []
    for salt in ("x", "x", "y"):
        r = client.completions.create(
            model=tiny.name, prompt=prompt, max_tokens=3, temperature=0,
            extra_body={"cache_salt": salt, "priority": 1},
        )  # fmt: skip
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        got.append(r.usage.prompt_tokens_details.cached_tokens)
    n = r.usage.prompt_tokens
    assert got == [0, n - 1, 0]
    ids = encode(tiny, system("generate") + "Q: name a shape.\nA:")
    url = base + "/inference/v1/generate"
    seen = []
    for salt in ("g", "g", "h"):
        body = {"token_ids": ids, "sampling_params": {"max_tokens": 3, "temperature": 0},
                "cache_salt": salt, "priority": -1}  # fmt: skip
        r2 = httpx.post(url, json=body, timeout=120)
        assert r2.status_code == 200, r2.text
        seen.append(r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert seen == [0, len(ids) - 1, 0]


def test_render_carries_the_salt_and_priority(base: str, tiny: LoadedModel) -> None:
    body = {"model": tiny.name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "cache_salt": "s", "priority": 4}  # fmt: skip
    r = httpx.post(base + "/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["cache_salt"] == "s" and r.json()["priority"] == 4


@pytest.mark.parametrize(
    "field, value",
    [
        ("priority", "high"),
        ("priority", 1.5),
        ("priority", True),
        ("priority", 2**31),
        ("cache_salt", ""),
        ("cache_salt", "s" * 257),
        ("cache_salt", ["a"]),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions", "generate"])
def test_bad_values_are_a_400_naming_the_field(
    base: str, tiny: LoadedModel, route: str, field: str, value: Any
) -> None:
    bodies = {
        "chat": ("/v1/chat/completions", {"model": tiny.name, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": "hi"}]}),
        "completions": ("/v1/completions", {"model": tiny.name, "prompt": "hi", "max_tokens": 1}),
        "generate": ("/inference/v1/generate", {"token_ids": [1, 2, 3]}),
    }  # fmt: skip
    path, body = bodies[route]
    r = httpx.post(base + path, json={**body, field: value}, timeout=60)
    assert_openai_error(r, 400, field)
