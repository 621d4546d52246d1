"""GET /metrics read by Prometheus' own text-format parser after a known set of requests: the
counts agree with what was sent and with the responses' `usage`; the route is behind the key."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omlx_logprobs.config import Access
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.server import TINY_NAME, thread_server, wait_idle

KEY = "sk-metrics-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Count to ten."}]


@pytest.fixture(scope="module")
def base(tiny: LoadedModel) -> Iterator[str]:
    with thread_server(replace(tiny, name=TINY_NAME), access=Access(api_key=KEY)) as (url, _):
        yield url


def scrape(base: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_agree_with_the_requests_sent(base: str, tiny: LoadedModel) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    usages: list[Any] = []
    reasons: list[str] = []
    for n in (3, 5):  # whole bodies, each ending at its length
        r = client.chat.completions.create(
            model=TINY_NAME, messages=MESSAGES, max_tokens=n, temperature=0
        )
        usages.append(r.usage)
        reasons.append(r.choices[0].finish_reason)
    stream = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        if chunk.choices and chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    eos = tiny.eos_token_ids[0]  # its end of text, made certain: a finish by "stop"
    c = client.completions.create(
        model=TINY_NAME, prompt="Hello", max_tokens=8, temperature=0, logit_bias={str(eos): 100}
    )
    usages.append(c.usage)
    reasons.append(c.choices[0].finish_reason)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, temperature=-1)
    assert reasons == ["length", "length", "length", "stop"]
    wait_idle(base)

    s = scrape(base)
    model = {"model_name": TINY_NAME}
    http = "omlx_http_requests_total"
    assert value(s, http, route="/v1/chat/completions", method="POST", status="200") == 3
    assert value(s, http, route="/v1/chat/completions", method="POST", status="400") == 1
    assert value(s, http, route="/v1/completions", method="POST", status="200") == 1
    assert value(s, "vllm:request_success_total", **model, finished_reason="length") == 3
    assert value(s, "vllm:request_success_total", **model, finished_reason="stop") == 1
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert value(s, "vllm:prompt_tokens_total", **model) == prompt
    assert value(s, "vllm:generation_tokens_total", **model) == generated
    assert value(s, "vllm:prefix_cache_queries_total", **model) == prompt
    assert value(s, "vllm:prefix_cache_hits_total", **model) == cached
    assert value(s, "vllm:time_to_first_token_seconds_count", **model) == 4
    assert value(s, "vllm:e2e_request_latency_seconds_count", **model) == 4
    # One gap per output after a choice's first; outputs a lagging reader merged count once.
    itl = value(s, "vllm:inter_token_latency_seconds_count", **model)
    assert 1 <= itl <= generated - 4
    assert value(s, "vllm:time_to_first_token_seconds_sum", **model) > 0
    assert value(s, "vllm:num_requests_running", **model) == 0
    assert value(s, "vllm:num_requests_waiting", **model) == 0
    assert value(s, "omlx_model_loaded", **model) == 1
    assert value(s, "omlx_memory_active_bytes", **model) > 0
    assert value(s, "omlx_engine_restarts_total", **model) == 0
    assert value(s, "vllm:spec_decode_num_draft_tokens_total", **model) == 0


def test_metrics_needs_the_key_and_health_does_not(base: str) -> None:
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    httpx.get(base + "/no/such/route", headers=AUTH, timeout=10)
    s = scrape(base)
    http = "omlx_http_requests_total"
    # The guard's refusal is counted under the route it guarded; a path nothing serves under one
    # label, however many such paths come.
    assert value(s, http, route="/metrics", method="GET", status="401") == 1
    assert value(s, http, route="unmatched", method="GET", status="404") == 1
    assert value(s, http, route="/health", method="GET", status="200") >= 1


def test_speculation_counts_the_predictions_drafts(base: str) -> None:
    """A prediction equal to the answer: its drafts are verified and taken; the engine's counts
    hold at least what `usage` says was accepted (a draft taken past the last token counts in
    the engine's, not in the answer's)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ask: dict[str, Any] = {"model": TINY_NAME, "messages": MESSAGES, "max_tokens": 24,
                           "temperature": 0}  # fmt: skip
    content = client.chat.completions.create(**ask).choices[0].message.content
    assert content
    before = scrape(base)
    r = client.chat.completions.create(**ask, prediction={"type": "content", "content": content})
    after = scrape(base)
    model = {"model_name": TINY_NAME}
    drafted, accepted = (
        value(after, f"vllm:spec_decode_num_{kind}_tokens_total", **model)
        - value(before, f"vllm:spec_decode_num_{kind}_tokens_total", **model)
        for kind in ("draft", "accepted")
    )
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    taken = r.usage.completion_tokens_details.accepted_prediction_tokens
    assert taken and drafted >= accepted >= taken


def test_metrics_read_while_a_load_runs(base: str) -> None:
    """Scraped over and over while requests run: the gauges see them, the counters never go
    back, and once idle the totals agree with the requests sent."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = {"model_name": TINY_NAME}
    first = scrape(base)
    busy: list[float] = []
    ends: list[float] = []

    def one(i: int) -> Any:
        return client.completions.create(
            model=TINY_NAME, prompt=f"Load {i}:", max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        while not all(f.done() for f in futures):
            s = scrape(base)
            busy.append(
                value(s, "vllm:num_requests_running", **model)
                + value(s, "vllm:num_requests_waiting", **model)
            )
            ends.append(value(s, "vllm:e2e_request_latency_seconds_count", **model))
        usages = [f.result().usage for f in futures]
    wait_idle(base)
    last = scrape(base)
    assert max(busy) >= 1 and ends == sorted(ends)

    def delta(name: str, **labels: str) -> float:
        return value(last, name, **labels) - value(first, name, **labels)

    assert delta("vllm:e2e_request_latency_seconds_count", **model) == 8
    assert delta("vllm:request_success_total", **model, finished_reason="length") == 8
    assert delta("vllm:generation_tokens_total", **model) == 8 * 48
    assert delta("vllm:prompt_tokens_total", **model) == sum(u.prompt_tokens for u in usages)
    assert value(last, "vllm:num_requests_running", **model) == 0


def test_no_metrics_serves_no_route(tiny: LoadedModel) -> None:
    """`--no-metrics`: /metrics is a 404 in OpenAI's error shape, and the requests still run."""
    with thread_server(tiny, metrics=False) as (url, _):
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": tiny.name, "messages": MESSAGES, "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        gone = httpx.get(url + "/metrics", timeout=10)
        assert gone.status_code == 404 and "error" in gone.json()
