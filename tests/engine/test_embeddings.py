"""Embedding requests in the engine (EngineRequest.embed): a Qwen3-Embedding-like directory in
its published layout (the base model's weights alone; the head tied, or absent as the 4B's)
loads, and each request's last hidden state, normalized, is sentence-transformers' embedding of
the same files; whole, chunked, seeded from a kept prefix, and beside generating requests in the
same steps (whose outputs stay what they are alone)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.headless import is_headless
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.types import EngineRequest, RequestOutput, SamplingParams
from tests.helpers.embedding import QUERY_PROMPT, compare, embedding_model_dir
from tests.helpers.embedding import reference_embeddings as st_embeddings
from tests.helpers.engine import client_of, collect_outputs

SHARED = QUERY_PROMPT + " " + " ".join(["context"] * 40)  # a start two prompts share
TEXTS = [
    SHARED + " first question?",  # these two in one step: their start kept and shared
    SHARED + " second question?",
    "The capital of France is Paris.",
    "a",
    " ".join(["long"] * 200),  # chunked at 160
]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def emb(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        tokenizer_dir: Path) -> tuple[Path, LoadedModel]:  # fmt: skip
    d = embedding_model_dir(tmp_path_factory.mktemp("emb"), tokenizer_dir, tied=request.param)
    assert is_headless(d)
    return d, load_model(str(d))


def run(model: LoadedModel, reqs: list[EngineRequest], cfg: EngineConfig) -> list[RequestOutput]:
    """Each request's last output; all submitted at once to a fresh engine."""
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, tokenizer=model.tokenizer)
    client = client_of(engine)

    async def main() -> list[list[list[RequestOutput]]]:
        return await asyncio.gather(*[collect_outputs(client, r) for r in reqs])

    try:
        return [o[0][-1] for o in asyncio.run(main())]
    finally:
        client.shutdown()


def embed_request(model: LoadedModel, i: int, text: str) -> EngineRequest:
    ids = list(model.tokenizer.encode(text, add_special_tokens=True))
    return EngineRequest(f"e{i}", ids, SamplingParams(max_tokens=0), embed=True)


@pytest.mark.parametrize("prefix_mib", [0, 64])
def test_embeddings_equal_sentence_transformers(
    emb: tuple[Path, LoadedModel], prefix_mib: int
) -> None:
    path, model = emb
    reqs = [embed_request(model, i, t) for i, t in enumerate(TEXTS)]
    cfg = EngineConfig(prefill_chunk=160, prefix_cache_mib=prefix_mib)
    outs = run(model, reqs, cfg)
    # with the prefix cache, the last two share their start: one prefilled from the other's
    assert (sum(o.cached_tokens for o in outs) > 0) == bool(prefix_mib)
    want = st_embeddings(path, TEXTS)
    for out, req, w in zip(outs, reqs, want):
        assert out.finished and out.error is None and out.embedding is not None
        assert out.prompt_tokens == len(req.prompt_ids) and out.completion_tokens == 0
        v = out.embedding / np.linalg.norm(out.embedding)
        cos, worst = compare(v, w)
        assert cos > 0.99999 and worst < 1e-4, (cos, worst)


def test_beside_generating_requests(emb: tuple[Path, LoadedModel]) -> None:
    """Embedding prompts prefilled in the steps of generating ones: the generated tokens and
    entries as when they run alone, the embeddings as when they run alone."""
    _, model = emb
    cfg = EngineConfig(prefill_chunk=64)
    gen = [
        EngineRequest(f"g{i}", list(model.tokenizer.encode(t)), SamplingParams(
            max_tokens=8, temperature=0, logprobs=True, top_logprobs=2), stream=False)
        for i, t in enumerate(["Hello there", "Once upon a time"])
    ]  # fmt: skip
    embeds = [embed_request(model, i, t) for i, t in enumerate(TEXTS)]
    alone = run(model, gen, cfg), run(model, embeds, cfg)
    mixed = run(model, [gen[0], *embeds[:3], gen[1], *embeds[3:]], cfg)
    together = [mixed[0], mixed[4]], [*mixed[1:4], *mixed[5:]]
    for a, b in zip(alone[0], together[0]):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.embedding is None
        assert a.logprobs is not None and b.logprobs is not None
        np.testing.assert_allclose(a.logprobs.logprobs, b.logprobs.logprobs, atol=1e-5)
    for a, b in zip(alone[1], together[1]):
        assert a.embedding is not None and b.embedding is not None
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
