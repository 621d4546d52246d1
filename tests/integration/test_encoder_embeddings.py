"""Encoder embedding models through the real server: tiny sentence-transformers directories
(tests/helpers/encoder.py: BERT with mean pooling and with CLS pooling, XLM-R with mean pooling,
all normalized) served on mlx-embeddings' forward beside the tiny llama. The `openai` SDK's
`embeddings.create` and the `ollama` SDK's `embed` give the vectors sentence-transformers' own
encode computes from the same files (transformers float32 on the CPU); concurrent requests
batch together and are each answered as alone; what an encoder cannot do, and bad input, are
400s in each API's shape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.helpers.embedding import close
from tests.helpers.embedding import reference_embeddings as st_embeddings
from tests.helpers.encoder import CONTEXT, encoder_model_dir
from tests.helpers.server import assert_api_error, server_process

MEAN, CLS, XLMR, TINY = "bert-mean", "bert-cls", "xlmr", "tiny"
TEXTS = [
    "The capital of France is Paris, on the Seine.",
    "Bananas are rich in potassium.",
    "Which river runs through Paris?",
    "a",
    "long " * 40,
    "Ünïcödé and\nnew lines\ttabs!",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        MEAN: encoder_model_dir(tmp_path_factory.mktemp("bert-mean"), "mean_tokens"),
        CLS: encoder_model_dir(tmp_path_factory.mktemp("bert-cls"), "cls_token", seed=99),
        XLMR: encoder_model_dir(tmp_path_factory.mktemp("xlmr"), seed=7, family="xlm-roberta"),
    }


@pytest.fixture(scope="module")
def base(dirs: dict[str, Path], tiny_dir: Path) -> Iterator[str]:
    args = [
        "--model", str(dirs[MEAN]), "--served-model-name", MEAN,
        "--model", str(dirs[CLS]), "--served-model-name", CLS,
        "--model", str(dirs[XLMR]), "--served-model-name", XLMR,
        "--model", str(tiny_dir), "--served-model-name", TINY,
        "--log-level", "warning",
    ]  # fmt: skip
    with server_process(args) as s:
        yield s.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> dict[str, np.ndarray]:
    return {name: st_embeddings(d, TEXTS) for name, d in dirs.items()}


@pytest.mark.parametrize("name", [MEAN, CLS, XLMR])
def test_openai_sdk(
    client: openai.OpenAI, reference: dict[str, np.ndarray], dirs: dict[str, Path], name: str
) -> None:
    from transformers import AutoTokenizer

    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=name, input=TEXTS)  # base64, as the SDK asks
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for f, b, want in zip(floats.data, decoded.data, reference[name]):
        close(f.embedding, want)
        assert np.abs(np.array(b.embedding) - np.array(f.embedding)).max() < 1e-6
        assert len(f.embedding) == 32 and abs(np.linalg.norm(f.embedding) - 1) < 1e-5
    tok = AutoTokenizer.from_pretrained(str(dirs[name]))
    ids = [tok.encode(t) for t in TEXTS]  # [CLS] ... [SEP]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert floats.model == name
    by_ids = client.embeddings.create(model=name, input=ids[:2], encoding_format="float")
    for d, want in zip(by_ids.data, reference[name]):
        close(d.embedding, want)


def test_ollama_sdk(base: str, reference: dict[str, np.ndarray]) -> None:
    c = ollama.Client(host=base)
    r = c.embed(model=MEAN, input=TEXTS)
    assert r.model == MEAN and len(r.embeddings) == len(TEXTS)
    for got, want in zip(r.embeddings, reference[MEAN]):
        close(got, want)
    assert r.prompt_eval_count and r.total_duration
    close(c.embed(model=CLS + ":latest", input=TEXTS[1]).embeddings[0], reference[CLS][1])
    close(c.embeddings(model=MEAN, prompt=TEXTS[2]).embedding, reference[MEAN][2])
    assert c.embed(model=MEAN, input=[]).embeddings == []


def test_concurrent_requests_batch(base: str, reference: dict[str, np.ndarray]) -> None:
    """24 requests on both encoders at once, beside a chat request on the llama: each vector
    as sentence-transformers' (padding in a batch changes nothing it pools)."""

    async def main() -> list[Any]:
        ac = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        chat = ac.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        jobs = [
            ac.embeddings.create(model=(MEAN, CLS)[i % 2], input=[TEXTS[i % len(TEXTS)]])
            for i in range(24)
        ]
        done = await asyncio.gather(chat, *jobs)
        await ac.close()
        return list(done)

    answered = asyncio.run(main())
    assert answered[0].usage.completion_tokens > 0
    for i, e in enumerate(answered[1:]):
        close(e.data[0].embedding, reference[(MEAN, CLS)[i % 2]][i % len(TEXTS)])


@pytest.mark.parametrize("name", [MEAN, XLMR])
def test_truncation(base: str, dirs: dict[str, Path], name: str) -> None:
    """Past the context (BERT's max_position_embeddings; XLM-R's less its pad id and one):
    OpenAI's route refuses, Ollama's cuts (keeping [SEP] last, as sentence-transformers'
    tokenizer truncates to its max_seq_length, the same 64)."""
    text = " ".join(["paris"] * (2 * CONTEXT))
    r = httpx.post(base + "/v1/embeddings", json={"model": name, "input": text}, timeout=60)
    assert_api_error(r, 400, "input", "/v1/embeddings")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    got = ollama.Client(host=base).embed(model=name, input=text)
    assert got.prompt_eval_count == CONTEXT
    close(got.embeddings[0], st_embeddings(dirs[name], [text])[0])
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).embed(model=name, input=text, truncate=False)
    assert e.value.status_code == 400


def test_capabilities(base: str) -> None:
    models = {m["id"]: m for m in httpx.get(base + "/v1/models").json()["data"]}
    assert models[MEAN]["capabilities"]["embeddings"] is True
    assert models[TINY]["capabilities"]["embeddings"] is False
    assert models[MEAN]["max_model_len"] == models[XLMR]["max_model_len"] == CONTEXT
    assert models[XLMR]["capabilities"]["embeddings"] is True
    shown = ollama.Client(host=base).show(MEAN)
    assert shown.capabilities is not None and "embedding" in shown.capabilities


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": [[1, 2], [10**6]]}, "input"),  # past the vocabulary
        ("/v1/embeddings", {"input": [0] * (CONTEXT + 1)}, "input"),
        ("/v1/embeddings", {"input": "a", "dimensions": 8}, "dimensions"),  # no Matryoshka
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "model"),
        ("/v1/completions", {"prompt": "a"}, "model"),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}, "model"),
    ],
)
def test_bad_openai_requests(base: str, path: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(base + path, json={"model": MEAN, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"] or "").split("[")[0] == param, err


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/embed", {"model": MEAN, "input": ["a", ""]}, "input"),
        ("/api/embed", {"model": MEAN, "input": "a", "dimensions": 4}, "dimensions"),
        ("/api/chat", {"model": MEAN, "messages": [{"role": "user", "content": "a"}]}, "model"),
        ("/api/generate", {"model": MEAN, "prompt": "a"}, "model"),
    ],
)
def test_bad_ollama_requests(base: str, path: str, body: dict[str, Any], field: str) -> None:
    r = httpx.post(base + path, json=body, timeout=60)
    assert_api_error(r, 400, field, path)


def test_sglang_generate_on_an_encoder_is_a_400(base: str) -> None:
    """SGLang's /generate serves the first --model, here the mean-pooled encoder."""
    body = {"input_ids": [2, 40, 3], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(base + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "model_not_supported"


def test_control_plane_and_weights(
    base: str, reference: dict[str, np.ndarray], dirs: dict[str, Path]
) -> None:
    """/pause and /resume reach every loaded model, encoders among them (nothing of theirs to
    pause); new weights for an encoder (the default model here) are a 400."""
    assert httpx.post(base + "/pause", timeout=60).status_code == 200
    assert httpx.post(base + "/resume", timeout=60).status_code == 200
    body = {"model_path": str(dirs[MEAN])}
    r = httpx.post(base + "/update_weights_from_disk", json=body, timeout=60)
    assert r.status_code == 400 and "encoder" in r.json()["error"]["message"], r.text
    got = httpx.post(base + "/api/embed", json={"model": MEAN, "input": TEXTS[0]}, timeout=60)
    close(got.json()["embeddings"][0], reference[MEAN][0])
