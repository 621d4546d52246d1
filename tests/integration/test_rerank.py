"""Rerank and score (/rerank, /v1/rerank, /v2/rerank, /score, /v1/score) through the real server,
with httpx and with Cohere's own SDK (its v1 and v2 clients): each score is p(yes) from the
completions route's `logprob_token_ids` numbers for the same prompt, and from an independent
forward pass; vLLM's response shapes; the 400s in OpenAI's error shape."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from omlx_logprobs.api.scoring.scores import MAX_PAIRS
from omlx_logprobs.api.scoring.template import YesNoTemplate
from omlx_logprobs.cli import main
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner.prefix_cache import shared_len
from tests.helpers.engine import encode, reference_logprobs
from tests.helpers.server import MODEL_NAME, server_process

QUERY = "Which city is the capital of France, and what river runs through it?"
DOCS = [
    "Paris is the capital of France; the Seine flows through the city.",
    "Bananas are rich in potassium.",
    "Berlin is the capital of Germany.",
    "The Loire is the longest river in France.",
]


def post(server: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server + path, json=body, timeout=120)


def completions_p_yes(
    server: str, embedded: LoadedModel, text: str
) -> tuple[float, float, list[int]]:
    """p(yes) from /v1/completions' logprob_token_ids for the prompt `text`, the same from an
    independent float32 forward pass, and the prompt's ids."""
    yes, no = embedded.vocab.token_text.index("yes"), embedded.vocab.token_text.index("no")
    body = {
        "model": MODEL_NAME,
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 2,
        "logprob_token_ids": [yes, no],
        "return_token_ids": True,
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    top = choice["logprobs"]["top_logprobs"][0]
    ids = choice["prompt_token_ids"]
    ref = reference_logprobs(embedded, ids)[-1].astype(float)
    return p_yes(top["yes"], top["no"]), p_yes(ref[yes], ref[no]), ids


def p_yes(lp_yes: float, lp_no: float) -> float:
    return math.exp(lp_yes) / (math.exp(lp_yes) + math.exp(lp_no))


def test_rerank_scores_are_the_completions_numbers(server: str, embedded: LoadedModel) -> None:
    r = post(server, "/v1/rerank", {"model": MODEL_NAME, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and body["model"] == MODEL_NAME
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)  # best first
    lengths = 0
    for x in results:
        assert x["document"] == {"text": DOCS[x["index"]]}
        text = YesNoTemplate().render(QUERY, DOCS[x["index"]])
        route, reference, ids = completions_p_yes(server, embedded, text)
        assert abs(x["relevance_score"] - route) < 1e-6
        assert abs(x["relevance_score"] - reference) < 1e-4
        assert 0 < x["relevance_score"] < 1
        lengths += len(ids)
    assert body["usage"] == {"prompt_tokens": lengths, "total_tokens": lengths}


def test_top_n_objects_instruction_and_every_path(server: str, embedded: LoadedModel) -> None:
    full = post(server, "/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
    body = {
        "query": QUERY,
        "documents": [{"text": d} for d in DOCS],
        "top_n": 2,
        "return_documents": False,
    }
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        assert r.json()["results"] == [
            {"index": x["index"], "relevance_score": x["relevance_score"]} for x in full[:2]
        ]
    asked = "Judge whether the passage names a river"
    r = post(server, "/rerank", {"query": QUERY, "documents": DOCS[:1], "instruction": asked})
    got = r.json()["results"][0]["relevance_score"]
    route, _, _ = completions_p_yes(server, embedded, YesNoTemplate().render(QUERY, DOCS[0], asked))
    assert abs(got - route) < 1e-6
    assert abs(got - next(x for x in full if x["index"] == 0)["relevance_score"]) > 1e-6


def test_score_shapes(server: str) -> None:
    by_doc = {
        x["index"]: x["relevance_score"]
        for x in post(server, "/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
    }
    for first, second in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
        r = post(server, "/score", {"model": MODEL_NAME, first: QUERY, second: DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))  # in the pairs' order
        assert all(d["object"] == "score" for d in body["data"])
        for d in body["data"]:
            assert abs(d["score"] - by_doc[d["index"]]) < 1e-6
        usage = body["usage"]
        assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
    # pairs: query i with item i; use_activation false gives the logit difference (vLLM's)
    pairs = {"queries": [QUERY, QUERY], "items": DOCS[:2], "use_activation": False}
    r = post(server, "/v1/score", pairs)
    logits = [d["score"] for d in r.json()["data"]]
    for i, diff in enumerate(logits):
        assert abs(1 / (1 + math.exp(-diff)) - by_doc[i]) < 1e-6


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"] * (MAX_PAIRS + 1)}, "documents"),
        ("/v1/rerank", {"query": " ", "documents": DOCS}, "query"),
        ("/v1/rerank", {"query": None, "documents": DOCS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "rank_fields": ["x"]}, "rank_fields"),
        ("/v1/rerank", {"query": QUERY, "documents": [{"text": "a", "id": 1}]}, "documents[0]"),
        ("/v1/rerank", {"query": QUERY, "documents": [" " * 10**6]}, "documents"),
        ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
        ("/score", {"text_1": [], "text_2": DOCS}, "text_1"),
        ("/score", {"query": QUERY, "documents": DOCS}, "query"),  # unknown: vLLM's is queries
        ("/score", {"documents": DOCS}, "queries"),
        ("/score", {"text_1": QUERY}, "text_2"),
    ],
)
def test_bad_requests_are_400s(server: str, path: str, body: dict[str, Any], param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param), error


@pytest.mark.skipif(
    mx.default_device() != mx.cpu,
    reason="a kept start must hold --break-even tokens, timed on a GPU (runner/prefix_cache.py)",
)
def test_documents_share_their_query_in_the_prefix_cache(
    server: str, embedded: LoadedModel
) -> None:
    """A query no earlier request sent: what the cache holds of it came from its documents,
    scored together: all but the first at least take the query's start from it."""
    query = "Which of these notes mention the blue heron seen at dawn by the old mill pond?" * 3
    docs = [f"Note {i}: {d}" for i, d in enumerate(DOCS)]
    r = post(server, "/score", {"queries": query, "documents": docs})
    usage = r.json()["usage"]
    ids = [encode(embedded, YesNoTemplate().render(query, d), True) for d in docs]
    shared = min(shared_len(ids[0], x) for x in ids[1:])
    assert shared > 60  # the template's start and the query
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len(docs) - 1) * (shared - shared % 8), (cached, shared)
    assert usage["prompt_tokens"] == sum(len(x) for x in ids)


def test_unknown_model_is_a_404(server: str) -> None:
    r = post(server, "/v1/rerank", {"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_pair_past_the_context_is_a_400(server: str, embedded: LoadedModel) -> None:
    long = "word " * (embedded.max_model_len + 10)
    r = post(server, "/rerank", {"query": QUERY, "documents": ["short", long]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "documents" and error["code"] == "context_length_exceeded"


def test_rerank_template_option(tmp_path: Path, embedded: LoadedModel) -> None:
    """--rerank-template's text is what every pair is written into; a file without the
    document's place stops the server before any model loads."""
    template = tmp_path / "yes_no.txt"
    template.write_text("{instruction}\nQuery: {query}\nPassage: {document}\nRelevant (yes/no):")
    bad = tmp_path / "bad.txt"
    bad.write_text("Query: {query}")
    with pytest.raises(SystemExit, match="--rerank-template: .* has no \\{document\\}"):
        main(["serve", "--rerank-template", str(bad)])
    with server_process(["--rerank-template", str(template), "--log-level", "warning"]) as s:
        r = post(s.base, "/rerank", {"query": QUERY, "documents": DOCS[:2], "instruction": "Rank"})
        assert r.status_code == 200, r.text
        for x in r.json()["results"]:
            text = YesNoTemplate(template.read_text()).render(QUERY, DOCS[x["index"]], "Rank")
            route, reference, _ = completions_p_yes(s.base, embedded, text)
            assert abs(x["relevance_score"] - route) < 1e-6
            assert abs(x["relevance_score"] - reference) < 1e-4


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cohere_client_reranks(server: str, embedded: LoadedModel, version: str) -> None:
    """Cohere's own SDK (`Client` posts to /v1/rerank, `ClientV2` to /v2/rerank) parses the
    answer: the best `top_n` documents, each score the completions route's p(yes)."""
    import cohere

    kw: dict[str, Any] = {"base_url": server, "api_key": "unused", "timeout": 120}
    co = cohere.Client(**kw) if version == "v1" else cohere.ClientV2(**kw)
    got = co.rerank(model=MODEL_NAME, query=QUERY, documents=DOCS, top_n=3)
    assert got.id is not None and got.id.startswith("rerank-")
    assert len(got.results) == 3
    routes = []
    for doc in DOCS:
        route, _, _ = completions_p_yes(server, embedded, YesNoTemplate().render(QUERY, doc))
        routes.append(route)
    best = sorted(range(len(DOCS)), key=lambda i: -routes[i])[:3]
    assert [x.index for x in got.results] == best
    for x in got.results:
        assert abs(x.relevance_score - routes[x.index]) < 1e-6
    assert got.meta is not None and got.meta.billed_units is not None
    assert got.meta.billed_units.input_tokens == sum(
        len(encode(embedded, YesNoTemplate().render(QUERY, d), True)) for d in DOCS
    )
    with pytest.raises(cohere.BadRequestError) as bad:  # the SDK's error for a 400
        co.rerank(model=MODEL_NAME, query=QUERY, documents=[])
    assert bad.value.body["error"]["param"] == "documents"
