"""Images cut into tiles in the engine: tiny seeded random Idefics3 and SmolVLM models
(tests/helpers/idefics3.py), each image several runs of placeholder tokens with the
processor's row, column and global-image markers between them (or one run, for an image of one
tile), served with the chosen-token, top-5 and prompt logprobs of transformers' float32 forward
of the same weights and images (1e-4): whole prompts grouped with a text prompt, and prompts
cut into chunks inside a tile and between tiles; a second turn about the same image from the
prefix cache, the encoder run once; the same model from an mlx-vlm directory."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.api.core.images import Image, expand
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.vision import encoder_of
from omlx_logprobs.runner.vision import ImageEmbedder
from omlx_logprobs.types import EngineRequest, ImageInput
from tests.engine.test_vision import check, engine_of, params, two_turns
from tests.helpers.engine import run_requests
from tests.helpers.idefics3 import tiny_idefics3_dir
from tests.helpers.vision import Reference, picture, png_bytes


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[LoadedModel, Reference]:
    path = tiny_idefics3_dir(tmp_path_factory.mktemp(request.param), tokenizer_dir, request.param)
    return load_model(str(path)), Reference(path)


def image_prompt(
    model: LoadedModel, text: str, pictures: list[Any]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A user turn with these images then `text`, through the model's processor."""
    assert model.vision is not None
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image(p, hashlib.sha256(png_bytes(p)).hexdigest(), "x") for p in pictures]
    return expand(model.vision, rendered, images, False)


def pixels_of(images: tuple[ImageInput, ...]) -> np.ndarray:
    """The prompt's pixel values as transformers takes them: one sample, its images' tiles."""
    return np.concatenate([i.pixels for i in images], axis=1)


def test_tiles_and_their_markers(served: tuple[LoadedModel, Reference]) -> None:
    """The Idefics3 cuts a 90 x 70 image into 2 x 2 tiles and the whole image (five runs of 4
    placeholders, each after its marker), a 30 x 200 one into 2 x 1 and the whole; the
    SmolVLM scales each to one tile (one run of 16). The encoder's rows equal transformers'."""
    model, reference = served
    assert model.vision is not None
    ids, images = image_prompt(model, "Compare them.", [picture(1, 90, 70), picture(2, 30, 200)])
    tiled = model.vision.family == "idefics3"
    assert [len(i.runs) for i in images] == ([5, 3] if tiled else [1, 1])
    assert [i.length for i in images] == ([20, 12] if tiled else [16, 16])
    grid = ["<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>", "<row_2_col_2>", "<global-img>"]
    markers = [grid, [grid[0], grid[2], grid[4]]] if tiled else [["<global-img>"]] * 2
    encoder = encoder_of(model.model)
    assert encoder is not None
    for image, marked in zip(images, markers):
        assert [ids[p] for p in image.positions()] == [model.vision.image_token_id] * image.length
        assert [model.tokenizer.convert_ids_to_tokens(ids[s - 1]) for s, _ in image.runs] == marked
        got = np.array(encoder(image.pixels).astype(mx.float32))
        np.testing.assert_allclose(got, reference.image_rows(image.pixels), atol=1e-5)


@pytest.mark.parametrize(
    "chunk, scored", [(7, True), (None, True), (None, False)], ids=["chunks", "groups", "plain"]
)
def test_tiled_images_and_text_batched_against_transformers(
    served: tuple[LoadedModel, Reference], chunk: int | None, scored: bool
) -> None:
    """Chunks of 7: each prompt with images is cut inside its tiles' runs and between them;
    whole prompts: image and text prompts prefill in one left-padded group."""
    model, reference = served
    one, first = image_prompt(model, "What is in this picture?", [picture(3, 90, 70)])
    two, both = image_prompt(model, "Compare them.", [picture(4, 40, 60), picture(5, 30, 200)])
    text = list(model.tokenizer.encode("A plain text prompt about nothing in particular"))
    recs = run_requests(
        engine_of(model, prefill_chunk=chunk),
        [
            EngineRequest("one", one, params(prompt=scored), stream=True, images=first),
            EngineRequest("txt", text, params(prompt=scored), stream=True),
            EngineRequest("two", two, params(prompt=scored), stream=True, images=both),
        ],
    )
    for rec, pix in zip(recs, [pixels_of(first), None, pixels_of(both)]):
        assert rec.error is None
        check(rec, reference.logprobs(rec.prompt_ids + list(rec.output_ids), pix))


def test_second_turn_from_the_prefix_cache(served: tuple[LoadedModel, Reference]) -> None:
    """A conversation's second turn about a tiled image takes the first turn's keys and values
    from the prefix cache, and the encoder is not run again."""
    model, reference = served
    ids, images = image_prompt(model, "Describe it.", [picture(6, 90, 70)])
    engine = engine_of(model)
    vision = engine.runner.prefill.vision
    assert isinstance(vision, ImageEmbedder)
    more = list(model.tokenizer.encode("<end_of_utterance>\nUser: And the colours?"))
    first, second = two_turns(engine, ids, images, more)
    assert vision.encoded == 1
    assert first.cached_tokens == 0 and second.cached_tokens >= len(ids)
    check(first, reference.logprobs(ids + list(first.output_ids), pixels_of(images)))
    turn = second.prompt_ids + list(second.output_ids)
    check(second, reference.logprobs(turn, pixels_of(images)))


def test_an_mlx_vlm_directory(
    served: tuple[LoadedModel, Reference], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same model as mlx-vlm writes it (its names: `language_model.`, `vision_model.` with
    the patch embedding in MLX's layout, `connector.`; SmolVLM's tied head has no
    `lm_head`): the same logits and image rows (within 1e-5)."""
    model, _ = served
    from mlx_vlm.models.idefics3 import Model as MlxVlmIdefics3

    out = tmp_path_factory.mktemp("mlx-vlm")
    for f in model.path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = dict(mx.load(str(model.path / "model.safetensors")))  # type: ignore[arg-type]
    named = MlxVlmIdefics3.sanitize(None, weights)  # its names (no use of the instance)
    conv = "vision_model.embeddings.patch_embedding.weight"
    named[conv] = named[conv].transpose(0, 2, 3, 1)
    mx.save_safetensors(str(out / "model.safetensors"), named)
    again = load_model(str(out))
    ids, images = image_prompt(model, "Same?", [picture(7, 90, 70)])
    probe = mx.array([ids[:12]])
    # the same weights: equal alone, 2e-6 apart once the engines above have run the first
    close = {"rtol": 0, "atol": 1e-5}
    np.testing.assert_allclose(np.array(again.model(probe)), np.array(model.model(probe)), **close)
    a, b = encoder_of(model.model), encoder_of(again.model)
    assert a is not None and b is not None
    np.testing.assert_allclose(
        np.array(a(images[0].pixels)), np.array(b(images[0].pixels)), **close
    )
