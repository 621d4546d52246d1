"""Gemma 3's images in the engine: a tiny seeded random Gemma 3 (tests/helpers/gemma3.py),
whose image placeholders attend to each other both ways in the prefill and enter its text
model unscaled, served with the chosen-token, top-5 and prompt logprobs of transformers'
float32 forward (with Gemma3Processor's `token_type_ids`) of the same weights and images
(1e-4): whole prompts grouped and left-padded with a text prompt; prompts in chunks shorter
than an image (no chunk ends inside one); a second turn about the same image, the encoder run
once; the same model from an mlx-vlm directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.batch.scheduler import Scheduler
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.vision import encoder_of
from omlx_logprobs.runner.vision import ImageEmbedder
from omlx_logprobs.types import EngineRequest
from tests.engine.test_vision import check, engine_of, image_prompt, params, two_turns
from tests.helpers.engine import run_requests
from tests.helpers.gemma3 import Gemma3Reference, tiny_gemma3_dir


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tiny_gemma3_dir(tmp_path_factory.mktemp("gemma3"), tokenizer_dir)


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path) -> LoadedModel:
    return load_model(str(gemma_dir))


@pytest.fixture(scope="module")
def reference(gemma_dir: Path) -> Gemma3Reference:
    return Gemma3Reference(gemma_dir)


def test_the_processors_placeholders_and_the_encoders_rows(
    gemma: LoadedModel, reference: Gemma3Reference
) -> None:
    """An image: 16 placeholders between its start and end tokens (after the line breaks the
    processor writes, which merge with the template's into one token); the encoder's rows are
    transformers' (tower, pooling, norm, projection) within 1e-5; its placeholders attend both
    ways (transformers' forward without `token_type_ids` is far from it)."""
    assert gemma.vision is not None and gemma.vision.expansion is not None
    ids, images = image_prompt(gemma, "What is in this picture?", [1])
    (image,) = images
    token, tok = gemma.vision.image_token_id, gemma.tokenizer
    assert image.runs == ((image.start, 16),)
    assert ids[image.start : image.end] == [token] * 16
    around = tok.convert_ids_to_tokens([ids[image.start - 1], ids[image.end]])
    assert around == ["<start_of_image>", "<end_of_image>"]
    encoder = encoder_of(gemma.model)
    assert encoder is not None and encoder.bidirectional
    got = np.array(encoder(image.pixels).astype(mx.float32))
    np.testing.assert_allclose(got, reference.image_rows(image.pixels), atol=1e-5)
    causal = super(Gemma3Reference, reference).logprobs(ids, image.pixels)
    assert np.abs(causal - reference.logprobs(ids, image.pixels)).max() > 0.1


@pytest.mark.parametrize(
    "chunk, scored", [(8, True), (8, False), (None, True), (None, False)],
    ids=["chunks-scored", "chunks", "groups-scored", "groups"],
)  # fmt: skip
def test_images_and_text_batched_against_transformers(
    gemma: LoadedModel, reference: Gemma3Reference, chunk: int | None, scored: bool
) -> None:
    """Chunks of 8, shorter than an image: each chunk ends before an image or after it (the
    image's 16 placeholders in one forward); whole prompts: image and text prompts prefill in
    one left-padded group (scored: the model's body, then its head on every position)."""
    one, first = image_prompt(gemma, "What is in this picture?", [2])
    two, both = image_prompt(gemma, "Compare them.", [3, 4])
    text = list(gemma.tokenizer.encode("A plain text prompt about nothing in particular"))
    recs = run_requests(
        engine_of(gemma, prefill_chunk=chunk),
        [
            EngineRequest("one", one, params(prompt=scored), stream=True, images=first),
            EngineRequest("txt", text, params(prompt=scored), stream=True),
            EngineRequest("two", two, params(prompt=scored), stream=True, images=both),
        ],
    )
    pixels = [first[0].pixels, None, np.concatenate([i.pixels for i in both])]
    for rec, pix in zip(recs, pixels):
        assert rec.error is None
        check(rec, reference.logprobs(rec.prompt_ids + list(rec.output_ids), pix))


def test_a_chunk_never_ends_inside_an_image(gemma: LoadedModel) -> None:
    """The scheduler's chunks of 8 over a prompt with an image at 11..27 (its placeholders):
    back to the image's start, then the image whole past the budget."""
    ids, images = image_prompt(gemma, "What is in this picture?", [2])
    start, end = images[0].start, images[0].end
    scheduler = Scheduler(4, 8, whole_runs=True)
    seq = Sequence.of(EngineRequest("a", ids, params(), images=images))
    scheduler.add(seq)
    ends = []
    while seq in scheduler.waiting:
        out = scheduler.schedule()
        ends.append(out.prefill[0].end)
        scheduler.update(out)
    assert start in ends and end in ends
    assert not any(start < e < end for e in ends)


def test_second_turn_from_the_prefix_cache(gemma: LoadedModel, reference: Gemma3Reference) -> None:
    """A conversation's second turn about the image: the encoder is not run again (its rows
    kept by the image's hash), and the answer is exact. (Its keys and values are computed
    again: Gemma's sliding-window layers have dropped a finished sequence's oldest keys, so
    the prefix cache keeps no finished sequence of this model, text or images.)"""
    ids, images = image_prompt(gemma, "Describe it.", [5])
    engine = engine_of(gemma)
    vision = engine.runner.prefill.vision
    assert isinstance(vision, ImageEmbedder) and engine.scheduler.whole_runs
    more = list(gemma.tokenizer.encode("<end_of_turn>\n<start_of_turn>user\nAnd the colours?"))
    first, second = two_turns(engine, ids, images, more)
    assert vision.encoded == 1
    assert second.prompt_ids[: len(ids)] == ids
    check(first, reference.logprobs(ids + list(first.output_ids), images[0].pixels))
    turn = second.prompt_ids + list(second.output_ids)
    check(second, reference.logprobs(turn, images[0].pixels))


def test_an_mlx_vlm_directory(gemma: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same model as mlx-vlm writes it (`language_model.model.`, its head copied to
    `language_model.lm_head.`, the tower under `vision_tower.vision_model.` with the patch
    embedding in MLX's layout, `multi_modal_projector.`): the same logits and image rows."""
    out = tmp_path_factory.mktemp("mlx-vlm")
    for f in gemma.path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = dict(mx.load(str(gemma.path / "model.safetensors")))  # type: ignore[arg-type]
    named = {}
    for k, v in weights.items():
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model."):
            k = "vision_tower.vision_model." + k.removeprefix("vision_tower.")
        named[k] = v.transpose(0, 2, 3, 1) if k.endswith("patch_embedding.weight") else v
    named["language_model.lm_head.weight"] = named["language_model.model.embed_tokens.weight"]
    mx.save_safetensors(str(out / "model.safetensors"), named)
    again = load_model(str(out))
    ids, images = image_prompt(gemma, "Same?", [6])
    probe = mx.array([ids[:12]])
    close = {"rtol": 0, "atol": 1e-5}
    np.testing.assert_allclose(np.array(again.model(probe)), np.array(gemma.model(probe)), **close)
    a, b = encoder_of(gemma.model), encoder_of(again.model)
    assert a is not None and b is not None
    np.testing.assert_allclose(
        np.array(a(images[0].pixels)), np.array(b(images[0].pixels)), **close
    )
