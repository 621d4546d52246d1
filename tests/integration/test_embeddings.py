"""Embeddings through the real server: a tiny Qwen3-Embedding-like directory (tests/helpers/
embedding.py) served beside the tiny llama as an embedding model (`--task embed`) and as a
generative one. The `openai` SDK's `embeddings.create` (float, and base64 as the SDK decodes it),
the `ollama` SDK's `embed` and `embeddings`, and Batch API lines give the vectors
sentence-transformers computes from the same files on transformers' float32 forward; many
embedding requests and a chat request at once are each answered as alone; bad input is a 400 in
each API's shape."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.embedding import QUERY_PROMPT, close, embedding_model_dir
from tests.helpers.embedding import reference_embeddings as st_embeddings
from tests.helpers.server import assert_api_error, server_process

EMB, TINY_EMB, TINY = "qwen3-embedding-tiny", "tiny-embed", "tiny"
CONTEXT = 512  # the embedding directory's max_position_embeddings
TEXTS = [
    "The capital of France is Paris, on the Seine.",
    "Bananas are rich in potassium.",
    QUERY_PROMPT + "Which river runs through Paris?",
    "a",
    "Ünïcödé, emoji 🙂 and\nnew lines\ttabs.",
    " ".join(["long"] * 150),  # chunked: --prefill-chunk 64
]


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return embedding_model_dir(tmp_path_factory.mktemp("qwen3-embedding"), tokenizer_dir)


@pytest.fixture(scope="module")
def base(emb_dir: Path, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [
        "--model", str(emb_dir), "--served-model-name", EMB, "--task", "auto",
        "--model", str(tiny_dir), "--served-model-name", TINY_EMB, "--task", "embed",
        "--model", str(tiny_dir), "--served-model-name", TINY, "--task", "generate",
        "--prefill-chunk", "64", "--batch-dir", str(tmp_path_factory.mktemp("batches")),
        "--log-level", "warning",
    ]  # fmt: skip
    with server_process(args) as s:
        yield s.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(emb_dir: Path) -> np.ndarray:
    return st_embeddings(emb_dir, TEXTS)


def test_openai_sdk_float_and_base64(
    client: openai.OpenAI, reference: np.ndarray, emb_dir: Path
) -> None:
    floats = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=EMB, input=TEXTS)  # the SDK asks base64, decodes
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for f, b, want in zip(floats.data, decoded.data, reference):
        close(f.embedding, want)
        # the same vector both ways (two requests: batched apart, so within float32 rounding)
        assert np.abs(np.array(b.embedding) - np.array(f.embedding)).max() < 1e-6
        assert abs(np.linalg.norm(f.embedding) - 1) < 1e-5
    tok = LoadedTokenizer.of(emb_dir)
    n = sum(len(tok.encode(t)) for t in TEXTS)  # each text with its appended <|endoftext|>
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    assert floats.model == EMB and floats.object == "list"


def test_token_ids_and_dimensions(
    client: openai.OpenAI, reference: np.ndarray, emb_dir: Path
) -> None:
    tok = LoadedTokenizer.of(emb_dir)
    ids = [tok.encode(t) for t in TEXTS[:3]]
    assert all(x[-1] == 0 for x in ids)  # <|endoftext|>, Qwen3-Embedding's last token
    many = client.embeddings.create(model=EMB, input=ids, encoding_format="float")
    for d, want in zip(many.data, reference):
        close(d.embedding, want)
    one = client.embeddings.create(model=EMB, input=ids[0], encoding_format="float")
    assert np.abs(np.array(one.data[0].embedding) - many.data[0].embedding).max() < 1e-6
    assert one.usage.prompt_tokens == len(ids[0])
    # Matryoshka: the first 16 components, normalized again
    cut = client.embeddings.create(model=EMB, input=TEXTS[:2], dimensions=16)
    for d, want in zip(cut.data, reference):
        assert len(d.embedding) == 16
        close(d.embedding, want[:16] / np.linalg.norm(want[:16]))


def test_ollama_sdk(base: str, reference: np.ndarray) -> None:
    c = ollama.Client(host=base)
    r = c.embed(model=EMB, input=TEXTS)
    assert r.model == EMB and len(r.embeddings) == len(TEXTS)
    for got, want in zip(r.embeddings, reference):
        close(got, want)
    assert r.prompt_eval_count and r.total_duration and r.load_duration is not None
    one = c.embed(model=EMB + ":latest", input=TEXTS[0], dimensions=8)
    close(one.embeddings[0], reference[0][:8] / np.linalg.norm(reference[0][:8]))
    close(c.embeddings(model=EMB, prompt=TEXTS[1]).embedding, reference[1])
    assert c.embed(model=EMB, input=[]).embeddings == []  # Ollama's way to load a model


def test_truncation(base: str, client: openai.OpenAI, emb_dir: Path) -> None:
    """Past the context: OpenAI's route refuses, Ollama's cuts (its default), keeping the
    appended <|endoftext|> last as a truncating tokenizer does; `truncate: false` refuses."""
    text = " ".join(f"w{i}" for i in range(2 * CONTEXT))
    r = httpx.post(base + "/v1/embeddings", json={"model": EMB, "input": text}, timeout=60)
    assert_api_error(r, 400, "input", "/v1/embeddings")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    got = ollama.Client(host=base).embed(model=EMB, input=text)
    assert got.prompt_eval_count == CONTEXT
    tok = LoadedTokenizer.of(emb_dir)
    cut = tok.encode(text, special=False)[: CONTEXT - 1] + [0]
    want = client.embeddings.create(model=EMB, input=cut, encoding_format="float")
    close(got.embeddings[0], np.array(want.data[0].embedding))
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).embed(model=EMB, input=text, truncate=False)
    assert e.value.status_code == 400


def test_task_embed_on_a_causal_model(client: openai.OpenAI, tiny: LoadedModel) -> None:
    """--task embed: the last position's final normed hidden state, normalized (no
    sentence-transformers files: nothing appended, no Matryoshka)."""
    ids = list(tiny.tokenizer.encode(TEXTS[0], add_special_tokens=True))
    h = np.array(tiny.model.model(mx.array([ids]))[0, -1].astype(mx.float32), np.float64)
    got = client.embeddings.create(model=TINY_EMB, input=TEXTS[0], encoding_format="float")
    close(got.data[0].embedding, (h / np.linalg.norm(h)).astype(np.float32))
    assert got.usage.prompt_tokens == len(ids)


def test_batched_with_a_chat_request(
    base: str, reference: np.ndarray, client: openai.OpenAI
) -> None:
    """Many embedding requests and a chat request on the same engine at once: every vector
    as sentence-transformers', the chat's answer as when it runs alone."""
    chat = {"model": EMB, "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 12, "temperature": 0}  # fmt: skip
    alone = client.chat.completions.create(**chat)  # type: ignore[call-overload]

    async def main() -> tuple[list[Any], Any]:
        ac = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        jobs = [ac.embeddings.create(model=EMB, input=[TEXTS[i % len(TEXTS)]]) for i in range(24)]
        together = await asyncio.gather(ac.chat.completions.create(**chat), *jobs)
        await ac.close()
        return list(together[1:]), together[0]

    embedded, answer = asyncio.run(main())
    for i, e in enumerate(embedded):
        close(e.data[0].embedding, reference[i % len(TEXTS)])
    assert answer.choices[0].message.content == alone.choices[0].message.content
    assert answer.usage.completion_tokens == alone.usage.completion_tokens > 0


def test_batch_api_lines(client: openai.OpenAI, reference: np.ndarray) -> None:
    rows = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": EMB, "input": t, "encoding_format": "float"}}
            for i, t in enumerate(TEXTS[:3])]  # fmt: skip
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": EMB, "input": ""}})  # fmt: skip
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.time() + 120
    while batch.status not in ("completed", "failed") and time.time() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == 3
    assert batch.output_file_id is not None and batch.error_file_id is not None
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    by_id = {r["custom_id"]: r["response"] for r in out}
    for i, want in enumerate(reference[:3]):
        assert by_id[f"e{i}"]["status_code"] == 200
        close(by_id[f"e{i}"]["body"]["data"][0]["embedding"], want)
    bad = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert bad[0]["custom_id"] == "bad" and bad[0]["response"]["status_code"] == 400


def test_capabilities(base: str) -> None:
    models = {m["id"]: m for m in httpx.get(base + "/v1/models").json()["data"]}
    assert models[EMB]["capabilities"]["embeddings"] is True
    assert models[TINY_EMB]["capabilities"]["embeddings"] is True
    assert models[TINY]["capabilities"]["embeddings"] is False
    shown = ollama.Client(host=base).show(EMB)
    assert shown.capabilities is not None and "embedding" in shown.capabilities
    assert "embedding" not in (ollama.Client(host=base).show(TINY).capabilities or [])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[1, 2], [49152]]}, "input"),  # past the vocabulary
        ({"input": [-1]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [["a"]]}, "input"),
        ({"input": None}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 65}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "truncate": True}, "truncate"),  # Ollama's field, not OpenAI's
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "a", "model": TINY}, "model"),  # served to generate only
        ({"input": "a", "model": TINY_EMB, "dimensions": 8}, "dimensions"),  # no Matryoshka
        (
            {"input": "a", "model": TINY_EMB, "dimensions": 8, "encoding_format": "base64"},
            "dimensions",
        ),  # fmt: skip
    ],
)
def test_bad_openai_requests(base: str, body: dict[str, Any], param: str) -> None:
    body = {"model": EMB, **body}
    r = httpx.post(base + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"] or "").split(".")[0].split("[")[0] == param, err


def test_unknown_model_is_a_404(base: str) -> None:
    r = httpx.post(base + "/v1/embeddings", json={"model": "nope", "input": "a"}, timeout=60)
    assert_api_error(r, 404, "model", "/v1/embeddings")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/embed", {"model": EMB, "input": [1, 2]}, "input"),
        ("/api/embed", {"model": EMB, "input": ["a", ""]}, "input"),
        ("/api/embed", {"model": TINY, "input": "a"}, "model"),
        ("/api/embed", {"model": TINY_EMB, "input": "a", "dimensions": 8}, "dimensions"),
        ("/api/embed", {"model": EMB, "input": "a", "dimensions": 0}, "dimensions"),
        ("/api/embed", {"model": EMB, "input": "a", "encoding_format": "float"}, "encoding_format"),
        ("/api/embed", {"input": "a"}, "model"),
        ("/api/embeddings", {"model": EMB, "prompt": ["a"]}, "prompt"),
    ],
)
def test_bad_ollama_requests(base: str, path: str, body: dict[str, Any], field: str) -> None:
    r = httpx.post(base + path, json=body, timeout=60)
    assert_api_error(r, 400, field, path)


class LoadedTokenizer:
    """The directory's tokenizer as transformers loads it (what sentence-transformers uses)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path))

    _cache: dict[str, LoadedTokenizer] = {}

    @classmethod
    def of(cls, path: Path) -> LoadedTokenizer:
        if str(path) not in cls._cache:
            cls._cache[str(path)] = cls(path)
        return cls._cache[str(path)]

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=special))
