"""Images in the engine: a tiny seeded random LLaVA (tests/helpers/vision.py) served with an
image, its chosen-token, top-5 and prompt logprobs against transformers' float32 forward of the
same weights and image (1e-4); image and text prompts in one continuous batch; a prompt cut into
chunks inside its image; the encoder run once per image, and a second turn about the same image
served from the prefix cache."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import pytest

from omlx_logprobs.api.core.images import Image, expand
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner.vision import ImageEmbedder
from omlx_logprobs.types import EngineRequest, ImageInput, SamplingParams
from tests.helpers.engine import Record, client_of, collect_outputs, run_requests
from tests.helpers.vision import Reference, picture, png_bytes, tiny_llava_dir

K = 5


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tiny_llava_dir(tmp_path_factory.mktemp("llava"), tokenizer_dir)


@pytest.fixture(scope="module")
def llava(llava_dir: Path) -> LoadedModel:
    return load_model(str(llava_dir))


@pytest.fixture(scope="module")
def reference(llava_dir: Path) -> Reference:
    return Reference(llava_dir)


def image_prompt(
    model: LoadedModel, text: str, seeds: list[int]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A user turn with these images then `text`, through the model's processor."""
    assert model.vision is not None
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    rendered = model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    pictures = [picture(s) for s in seeds]
    images = [Image(p, hashlib.sha256(png_bytes(p)).hexdigest(), "x") for p in pictures]
    return expand(model.vision, rendered, images, False)


def params(n: int = 6) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, temperature=0.0, logprobs=True, top_logprobs=K, prompt_logprobs=K
    )


def engine_of(model: LoadedModel, **cfg: object) -> Engine:
    return Engine(
        model.model, model.vocab, model.eos_token_ids, EngineConfig(**cfg),  # type: ignore[arg-type]
        tokenizer=model.tokenizer,
    )  # fmt: skip


def check(rec: Record, ref: np.ndarray) -> None:
    """Greedy output, its entries and every prompt position against the reference rows."""
    prompt, out = rec.prompt_ids, list(rec.output_ids)
    assert rec.store is not None and rec.prompt_store is not None
    assert len(out) == len(rec.store)
    for j, tok in enumerate(out):
        row = ref[len(prompt) - 1 + j]
        assert tok == int(np.argmax(row))
        assert abs(rec.store.logprobs[j] - row[tok]) < 1e-4
        _, lps = rec.store.top(j)
        np.testing.assert_allclose(np.array(lps), np.sort(row)[::-1][:K], atol=1e-4)
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        assert rec.prompt_store.token_ids[i - 1] == prompt[i]
        assert abs(rec.prompt_store.logprobs[i - 1] - row[prompt[i]]) < 1e-4
        _, lps = rec.prompt_store.top(i - 1)
        np.testing.assert_allclose(np.array(lps), np.sort(row)[::-1][:K], atol=1e-4)


def test_image_and_text_batched_against_transformers(
    llava: LoadedModel, reference: Reference
) -> None:
    ids, images = image_prompt(llava, "What is in this picture?", [1])
    assert len(images) == 1 and images[0].length == 16
    assert ids[images[0].start : images[0].end] == [llava.vision.image_token_id] * 16  # type: ignore[union-attr]
    two, both = image_prompt(llava, "Compare them.", [2, 3])
    text = list(llava.tokenizer.encode("A plain text prompt about nothing in particular"))
    # Chunks of 8: each prompt with images is cut inside an image.
    engine = engine_of(llava, prefill_chunk=8)
    recs = run_requests(
        engine,
        [
            EngineRequest("img", ids, params(), stream=True, images=images),
            EngineRequest("txt", text, params(), stream=True),
            EngineRequest("two", two, params(), stream=True, images=both),
        ],
    )
    pixels = np.concatenate([i.pixels for i in both])
    for rec, pix in zip(recs, [images[0].pixels, None, pixels]):
        assert rec.error is None
        check(rec, reference.logprobs(rec.prompt_ids + list(rec.output_ids), pix))


def test_encoder_once_and_second_turn_from_the_prefix_cache(
    llava: LoadedModel, reference: Reference
) -> None:
    ids, images = image_prompt(llava, "Describe it.", [4])
    engine = engine_of(llava)
    vision = engine.runner.prefill.vision
    assert isinstance(vision, ImageEmbedder)
    first = run_requests(engine, [EngineRequest("a", ids, params(), stream=True, images=images)])[0]
    assert vision.encoded == 1
    # The next turn: the first answer, then a question, about the same image.
    turn = ids + list(first.output_ids) + list(llava.tokenizer.encode("\nAnd the colours?"))
    engine = engine_of(llava)  # a fresh engine whose runner holds the same encoder cache
    engine.runner.prefill.vision = vision
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=K)
    again = run_requests(
        engine,
        [
            EngineRequest("b", ids, params(), stream=True, images=images),
            EngineRequest("c", turn, sp, stream=True, images=images),
        ],
    )
    assert vision.encoded == 1  # neither request ran the encoder again
    ref = reference.logprobs(ids + list(again[0].output_ids), images[0].pixels)
    check(again[0], ref)
    ref = reference.logprobs(turn + list(again[1].output_ids), images[0].pixels)
    for j, tok in enumerate(again[1].output_ids):
        assert abs(again[1].store.logprobs[j] - ref[len(turn) - 1 + j][tok]) < 1e-4  # type: ignore[union-attr]


def test_another_image_in_the_same_place_takes_nothing_kept(
    llava: LoadedModel, reference: Reference
) -> None:
    """The same text about another image: the same ids, so only the images' hashes in the
    prefix cache's key keep the first image's keys and values from serving the second."""
    ids, first = image_prompt(llava, "Which animal is it?", [10])
    same, second = image_prompt(llava, "Which animal is it?", [11])
    assert same == ids and first[0].digest != second[0].digest
    reqs = [EngineRequest(name, ids, params(), stream=True, images=images)
            for name, images in (("a", first), ("b", second), ("c", first))]  # fmt: skip
    client = client_of(engine_of(llava))

    async def one_by_one() -> list[Record]:
        return [Record(r, (await collect_outputs(client, r))[0]) for r in reqs]

    try:
        recs = asyncio.run(one_by_one())
    finally:
        client.shutdown()
    assert recs[0].cached_tokens == 0 and recs[1].cached_tokens == 0
    assert recs[2].cached_tokens > 0  # the first image's prompt again: from the prefix cache
    for rec, images in zip(recs, (first, second, first)):
        check(rec, reference.logprobs(ids + list(rec.output_ids), images[0].pixels))
