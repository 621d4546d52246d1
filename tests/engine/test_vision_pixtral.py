"""Pixtral's towers in the engine: tiny seeded random Mistral 3 and Pixtral LLaVA models
(tests/helpers/pixtral.py), each image rows of placeholders with `[IMG_BREAK]` between them
and `[IMG_END]` after (a run a row, as many rows and columns as the image's size makes), served
with the chosen-token, top-5 and prompt logprobs of transformers' float32 forward of the same
weights and images (1e-4): whole prompts grouped with a text prompt, and prompts cut into
chunks inside a row and between rows; a second turn about the same image from the prefix
cache, the encoder run once; the same model from an mlx-vlm directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.vision import encoder_of
from omlx_logprobs.runner.vision import ImageEmbedder
from omlx_logprobs.types import EngineRequest, ImageInput
from tests.engine.test_vision import check, engine_of, params, two_turns
from tests.engine.test_vision_tiles import image_prompt
from tests.helpers.engine import run_requests
from tests.helpers.pixtral import tiny_pixtral_dir
from tests.helpers.vision import Reference, picture


@pytest.fixture(scope="module", params=["mistral3", "pixtral"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[LoadedModel, Reference]:
    path = tiny_pixtral_dir(tmp_path_factory.mktemp(request.param), tokenizer_dir, request.param)
    return load_model(str(path)), Reference(path)


def batch_of(images: tuple[ImageInput, ...]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The prompt's pixel values as transformers takes them (each image padded to the largest,
    as the processor pads a batch) and each image's size."""
    sizes = [(i.pixels.shape[-2], i.pixels.shape[-1]) for i in images]
    h, w = max(s[0] for s in sizes), max(s[1] for s in sizes)
    out = np.zeros((len(images), 3, h, w), np.float32)
    for k, (image, (a, b)) in enumerate(zip(images, sizes)):
        out[k, :, :a, :b] = image.pixels[0]
    return out, sizes


def reference_of(
    reference: Reference, ids: list[int], images: tuple[ImageInput, ...] | None
) -> np.ndarray:
    if not images:
        return reference.logprobs(ids)
    return reference.logprobs(ids, *batch_of(images))


def test_rows_of_placeholders_and_their_breaks(served: tuple[LoadedModel, Reference]) -> None:
    """A 40 x 60 image is 4 rows of 3 placeholders, a 70 x 30 one 2 rows of 4 (the image's
    size decides): `[IMG_BREAK]` after each row but the last, `[IMG_END]` after it. The
    encoder's rows (Mistral 3's merged 2 x 2 blocks; the LLaVA's patches) equal
    transformers'."""
    model, reference = served
    assert model.vision is not None
    ids, images = image_prompt(model, "Compare them.", [picture(1), picture(2, 70, 30)])
    assert [[n for _, n in i.runs] for i in images] == [[3, 3, 3, 3], [4, 4]]
    encoder = encoder_of(model.model)
    assert encoder is not None
    for image in images:
        after = [model.tokenizer.convert_ids_to_tokens(ids[s + n]) for s, n in image.runs]
        assert after == ["[IMG_BREAK]"] * (len(image.runs) - 1) + ["[IMG_END]"]
        assert [ids[p] for p in image.positions()] == [model.vision.image_token_id] * image.length
        got = np.array(encoder(image.pixels).astype(mx.float32))
        want = reference.image_rows(image.pixels, [image.pixels.shape[-2:]])
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "chunk, scored", [(5, True), (None, True), (None, False)], ids=["chunks", "groups", "plain"]
)
def test_images_and_text_batched_against_transformers(
    served: tuple[LoadedModel, Reference], chunk: int | None, scored: bool
) -> None:
    """Chunks of 5: each prompt with images is cut inside its rows and between them; whole
    prompts: image and text prompts prefill in one left-padded group."""
    model, reference = served
    one, first = image_prompt(model, "What is in this picture?", [picture(3, 60, 40)])
    two, both = image_prompt(model, "Compare them.", [picture(4), picture(5, 64, 64)])
    text = list(model.tokenizer.encode("A plain text prompt about nothing in particular"))
    recs = run_requests(
        engine_of(model, prefill_chunk=chunk),
        [
            EngineRequest("one", one, params(prompt=scored), stream=True, images=first),
            EngineRequest("txt", text, params(prompt=scored), stream=True),
            EngineRequest("two", two, params(prompt=scored), stream=True, images=both),
        ],
    )
    for rec, images in zip(recs, [first, None, both]):
        assert rec.error is None
        check(rec, reference_of(reference, rec.prompt_ids + list(rec.output_ids), images))


def test_second_turn_from_the_prefix_cache(served: tuple[LoadedModel, Reference]) -> None:
    """A conversation's second turn about an image takes the first turn's keys and values
    from the prefix cache, and the encoder is not run again."""
    model, reference = served
    ids, images = image_prompt(model, "Describe it.", [picture(6, 50, 30)])
    engine = engine_of(model)
    vision = engine.runner.prefill.vision
    assert isinstance(vision, ImageEmbedder)
    more = list(model.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd the colours?"))
    first, second = two_turns(engine, ids, images, more)
    assert vision.encoded == 1
    assert first.cached_tokens == 0 and second.cached_tokens >= len(ids)
    check(first, reference_of(reference, ids + list(first.output_ids), images))
    check(second, reference_of(reference, second.prompt_ids + list(second.output_ids), images))


def test_an_mlx_vlm_directory(
    served: tuple[LoadedModel, Reference],
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
) -> None:
    """The same model as mlx-vlm writes it (its names: `language_model.model.`,
    `language_model.lm_head`, `vision_tower.vision_model.` with the patch convolution in
    MLX's layout, `multi_modal_projector.`; Pixtral-12B's config under mlx-vlm's model type
    `pixtral`): the same logits and image rows; its encoder takes new weights under
    transformers' names."""
    model, _ = served
    from mlx_vlm.models.mistral3 import Model as MlxVlmMistral3

    out = tmp_path_factory.mktemp("mlx-vlm")
    for f in model.path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = dict(mx.load(str(model.path / "model.safetensors")))  # type: ignore[arg-type]
    named = MlxVlmMistral3.sanitize(None, weights)  # its names (no use of the instance)
    conv = "vision_tower.vision_model.patch_conv.weight"
    assert conv in named and "language_model.lm_head.weight" in named
    named[conv] = named[conv].transpose(0, 2, 3, 1)
    mx.save_safetensors(str(out / "model.safetensors"), named)
    if model.vision is not None and model.vision.family == "pixtral":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "model_type": "pixtral"}))
    again = load_model(str(out))
    ids, images = image_prompt(model, "Same?", [picture(7)])
    probe = mx.array([ids[:12]])
    close = {"rtol": 0, "atol": 1e-5}
    np.testing.assert_allclose(np.array(again.model(probe)), np.array(model.model(probe)), **close)
    a, b = encoder_of(model.model), encoder_of(again.model)
    assert a is not None and b is not None
    np.testing.assert_allclose(
        np.array(a(images[0].pixels)), np.array(b(images[0].pixels)), **close
    )
    # new weights under transformers' names (a trainer's checkpoint) replace the encoder's:
    # another seed's tower and projector give other rows; these weights, the same again
    assert model.vision is not None
    family = model.vision.family
    other = tiny_pixtral_dir(tmp_path_factory.mktemp("seed-1"), tokenizer_dir, family, seed=1)
    put = b.new_weights(dict(mx.load(str(other / "model.safetensors"))))  # type: ignore[arg-type]
    assert put is not None
    put()
    assert np.abs(np.array(a(images[0].pixels)) - np.array(b(images[0].pixels))).max() > 1e-3
    put = b.new_weights(weights)
    assert put is not None
    put()
    np.testing.assert_allclose(
        np.array(a(images[0].pixels)), np.array(b(images[0].pixels)), **close
    )


def test_a_processor_past_the_tower_is_refused_at_load(
    served: tuple[LoadedModel, Reference], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A checkpoint whose processor scales images past its tower's `image_size` (the rotary
    table's reach) is refused at load, named, not failed image by image in the engine."""
    model, _ = served
    out = tmp_path_factory.mktemp("too-large")
    for f in model.path.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    for f in out.glob("*.json"):
        text = f.read_text()
        if '"longest_edge"' in text:
            f.write_text(text.replace('"longest_edge": 64', '"longest_edge": 128'))
    with pytest.raises(ValueError, match="past the Pixtral tower's image_size of 64"):
        load_model(str(out))
