"""Images in the engine: a tiny seeded random LLaVA (tests/helpers/vision.py) served with an
image, its chosen-token, top-5 and prompt logprobs against transformers' float32 forward of the
same weights and image (1e-4); image and text prompts in one continuous batch; a prompt cut into
chunks inside its image; the encoder run once per image, and a second turn about the same image
served from the prefix cache."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.api.core.images import Image, expand
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.vision import encoder_of
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


def params(n: int = 6, prompt: bool = True) -> SamplingParams:
    return SamplingParams(
        max_tokens=n,
        temperature=0.0,
        logprobs=True,
        top_logprobs=K,
        prompt_logprobs=K if prompt else None,
    )


def engine_of(model: LoadedModel, **cfg: object) -> Engine:
    return Engine(
        model.model, model.vocab, model.eos_token_ids, EngineConfig(**cfg),  # type: ignore[arg-type]
        tokenizer=model.tokenizer,
    )  # fmt: skip


def check(rec: Record, ref: np.ndarray) -> None:
    """Greedy output, its entries and every prompt position (where asked) against the
    reference rows."""
    prompt, out = rec.prompt_ids, list(rec.output_ids)
    assert rec.store is not None
    assert len(out) == len(rec.store)
    for j, tok in enumerate(out):
        row = ref[len(prompt) - 1 + j]
        assert tok == int(np.argmax(row))
        assert abs(rec.store.logprobs[j] - row[tok]) < 1e-4
        _, lps = rec.store.top(j)
        np.testing.assert_allclose(np.array(lps), np.sort(row)[::-1][:K], atol=1e-4)
    if rec.params.prompt_logprobs is None:
        return
    assert rec.prompt_store is not None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        assert rec.prompt_store.token_ids[i - 1] == prompt[i]
        assert abs(rec.prompt_store.logprobs[i - 1] - row[prompt[i]]) < 1e-4
        _, lps = rec.prompt_store.top(i - 1)
        np.testing.assert_allclose(np.array(lps), np.sort(row)[::-1][:K], atol=1e-4)


def two_turns(
    engine: Engine, ids: list[int], images: tuple[ImageInput, ...], more: list[int]
) -> tuple[Record, Record]:
    """A first turn about the images, then a second: the first's prompt and answer and
    `more`, the same images in their places."""
    client = client_of(engine)
    first_req = EngineRequest("a", ids, params(prompt=False), stream=True, images=images)

    async def conversation() -> tuple[Record, Record]:
        first = Record(first_req, (await collect_outputs(client, first_req))[0])
        turn = ids + list(first.output_ids) + more
        req = EngineRequest("b", turn, params(prompt=False), stream=True, images=images)
        return first, Record(req, (await collect_outputs(client, req))[0])

    try:
        return asyncio.run(conversation())
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    "chunk, scored", [(8, True), (None, True), (None, False)], ids=["chunks", "groups", "plain"]
)
def test_image_and_text_batched_against_transformers(
    llava: LoadedModel, reference: Reference, chunk: int | None, scored: bool
) -> None:
    """Chunks of 8: each prompt with images is cut inside an image; whole prompts: image and
    text prompts prefill in one left-padded group (scored: the model's body, then its head on
    every position; plain: the last position's logits only)."""
    ids, images = image_prompt(llava, "What is in this picture?", [1])
    assert len(images) == 1 and images[0].length == 16
    assert ids[images[0].start : images[0].end] == [llava.vision.image_token_id] * 16  # type: ignore[union-attr]
    two, both = image_prompt(llava, "Compare them.", [2, 3])
    text = list(llava.tokenizer.encode("A plain text prompt about nothing in particular"))
    engine = engine_of(llava, prefill_chunk=chunk)
    recs = run_requests(
        engine,
        [
            EngineRequest("img", ids, params(prompt=scored), stream=True, images=images),
            EngineRequest("txt", text, params(prompt=scored), stream=True),
            EngineRequest("two", two, params(prompt=scored), stream=True, images=both),
        ],
    )
    pixels = np.concatenate([i.pixels for i in both])
    for rec, pix in zip(recs, [images[0].pixels, None, pixels]):
        assert rec.error is None
        check(rec, reference.logprobs(rec.prompt_ids + list(rec.output_ids), pix))


def test_encoder_once_and_second_turn_from_the_prefix_cache(
    llava: LoadedModel, reference: Reference
) -> None:
    """A conversation's second turn about an image takes the first turn's keys and values
    from the prefix cache (the image's among them), and the encoder is not run again; with an
    empty prefix cache, the encoder's kept rows serve the image again."""
    ids, images = image_prompt(llava, "Describe it.", [4])
    engine = engine_of(llava)
    vision = engine.runner.prefill.vision
    assert isinstance(vision, ImageEmbedder)
    got = np.array(vision.encoder(images[0].pixels).astype(mx.float32))  # not kept: a look
    np.testing.assert_allclose(got, reference.image_rows(images[0].pixels), atol=1e-5)
    more = list(llava.tokenizer.encode("\nAnd the colours?"))
    first, second = two_turns(engine, ids, images, more)
    assert vision.encoded == 1
    assert first.cached_tokens == 0 and second.cached_tokens >= len(ids)
    check(first, reference.logprobs(ids + list(first.output_ids), images[0].pixels))
    turn = second.prompt_ids + list(second.output_ids)
    check(second, reference.logprobs(turn, images[0].pixels))
    engine = engine_of(llava)  # no kept sequences; the same encoder rows, kept by hash
    engine.runner.prefill.vision = vision
    third = run_requests(engine, [EngineRequest("c", ids, params(), stream=True, images=images)])
    assert vision.encoded == 1 and third[0].cached_tokens == 0
    check(third[0], reference.logprobs(ids + list(third[0].output_ids), images[0].pixels))


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


def test_choices_of_a_prompt_with_images(llava: LoadedModel, reference: Reference) -> None:
    """n = 3 choices, prefilled once (the one-prompt path, with its input embeddings), each
    sampled on its own: every entry against the reference."""
    ids, images = image_prompt(llava, "Tell me about it.", [12])
    sp = SamplingParams(max_tokens=5, temperature=1.0, seed=7, logprobs=True, top_logprobs=K)
    req = EngineRequest("n", ids, sp, n=3, stream=True, images=images)
    client = client_of(engine_of(llava))
    try:
        choices = asyncio.run(collect_outputs(client, req))
    finally:
        client.shutdown()
    assert len(choices) == 3
    for outs in choices:
        rec = Record(req, outs)
        assert rec.error is None and rec.store is not None
        ref = reference.logprobs(ids + list(rec.output_ids), images[0].pixels)
        for j, tok in enumerate(rec.output_ids):
            row = ref[len(ids) - 1 + j]
            assert abs(rec.store.logprobs[j] - row[tok]) < 1e-4
            _, lps = rec.store.top(j)
            np.testing.assert_allclose(np.array(lps), np.sort(row)[::-1][:K], atol=1e-4)


def test_a_siglip_tower(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> None:
    """LLaVA with a SigLIP tower (no class token, the `full` feature strategy, the tanh GELU
    that mlx-vlm's tower is given here: models/vision.py), scored and chunked inside its
    image, against transformers."""
    path = tiny_llava_dir(tmp_path_factory.mktemp("siglip"), tokenizer_dir, tower="siglip")
    model = load_model(str(path))
    ids, images = image_prompt(model, "What is in it?", [13])
    assert images[0].length == 16
    # The encoder's rows themselves: the logprobs of a tiny model may hide a small difference.
    encoder, reference = encoder_of(model.model), Reference(path)
    assert encoder is not None
    got = np.array(encoder(images[0].pixels).astype(mx.float32))
    np.testing.assert_allclose(got, reference.image_rows(images[0].pixels), atol=1e-5)
    rec = run_requests(
        engine_of(model, prefill_chunk=8),
        [EngineRequest("s", ids, params(), stream=True, images=images)],
    )[0]
    check(rec, reference.logprobs(ids + list(rec.output_ids), images[0].pixels))
