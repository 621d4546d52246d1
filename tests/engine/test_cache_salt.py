"""vLLM's `cache_salt` on the engine: the salt's namespace keys every kept prefix, so a prompt
sent again under another salt (or none) takes nothing from the cache, while the same salt takes
all of it but its last token; salted answers equal unsalted ones (1e-4 of a full forward)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient
from omlx_logprobs.types import EngineRequest, RequestOutput, SamplingParams, cache_namespace
from tests.helpers.engine import Record, check_against_reference, client_of, collect_outputs
from tests.helpers.engine import encode as encode_text


@pytest.fixture
def client(tiny: LoadedModel) -> Iterator[EngineClient]:
    cfg = EngineConfig(prefill_chunk=64, prefix_cache_mib=64)
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, cfg, tiny.tokenizer)
    c = client_of(engine)
    yield c
    c.shutdown()


PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)


def send(client: EngineClient, rid: str, prompt: list[int], salt: str | None) -> Record:
    req = EngineRequest(rid, prompt, PARAMS, stream=True, cache_namespace=cache_namespace(salt))

    async def main() -> list[list[RequestOutput]]:
        return await collect_outputs(client, req)

    return Record(req, asyncio.run(main())[0])


def test_a_prompt_hits_the_cache_only_under_its_own_salt(
    tiny: LoadedModel, client: EngineClient
) -> None:
    prompt = encode_text(tiny, "A system turn that every rollout of the group shares. " * 3)
    hit = len(prompt) - 1  # the prompt's last token is always computed
    order = [("a", 0), ("b", 0), (None, 0), ("a", hit), ("b", hit), (None, hit), ("c", 0)]
    records = []
    for i, (salt, want) in enumerate(order):
        r = send(client, f"r{i}", prompt, salt)
        assert r.error is None and r.cached_tokens == want, (i, salt, r.cached_tokens)
        check_against_reference(tiny, prompt, r, 2)
        records.append(r)
    assert len({tuple(r.output_ids) for r in records}) == 1
