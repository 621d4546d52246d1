"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL in the engine: tiny seeded random models
(tests/helpers/qwen_vl.py) whose rotary positions are multimodal (an image's placeholders at
their frame, row and column, the text after it counting on from the largest; Qwen3-VL's
deepstack rows besides), served with the chosen-token, top-5 and prompt logprobs of
transformers' float32 forward of the same weights and images (1e-4): image and text prompts
grouped in one left-padded prefill and decoded in one batch (each image row's decode positions
moved by its prompt's delta), prompts cut into chunks inside an image, a second turn about the
same image from the prefix cache batched with a text request, the encoder run once, n choices
of one prompt; the same model from an mlx-vlm directory."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.models.vision import encoder_of
from omlx_logprobs.models.vision_qwen import positions
from omlx_logprobs.runner.vision import ImageEmbedder
from omlx_logprobs.types import EngineRequest, SamplingParams
from tests.engine.test_vision import check, engine_of, params
from tests.engine.test_vision_tiles import image_prompt
from tests.helpers.engine import Record, client_of, collect_outputs, run_requests
from tests.helpers.qwen_vl import QwenReference, tiny_qwen_vl_dir
from tests.helpers.vision import picture


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[LoadedModel, QwenReference]:
    path = tiny_qwen_vl_dir(tmp_path_factory.mktemp(request.param), tokenizer_dir, request.param)
    return load_model(str(path)), QwenReference(path)


def test_positions_and_rows_are_transformers(served: tuple[LoadedModel, QwenReference]) -> None:
    """Two images of other shapes, the vision markers between: each image one run of
    placeholders (its grid of merged patches), their M-RoPE positions and the prompt's delta
    as transformers' `get_rope_index` gives them, the encoder's rows as its tower and merger
    give them."""
    model, reference = served
    assert model.vision is not None
    ids, images = image_prompt(model, "Compare them.", [picture(1), picture(2, 90, 40)])
    assert [i.runs for i in images] == [((4, 6),), ((12, 6),)]
    assert [i.pixels.shape[1:4] for i in images] == [(1, 6, 4), (1, 4, 6)]
    want, delta = reference.rope_index(ids, images)
    got = positions(images, len(ids))
    np.testing.assert_array_equal(got, want)
    assert int(got.max()) + 1 - len(ids) == delta < 0
    np.testing.assert_array_equal(positions(images, 15), want[:, :15])  # a chunk's prefix
    encoder = encoder_of(model.model)
    assert encoder is not None
    for image in images:
        rows = np.array(encoder(image.pixels).astype(mx.float32))
        np.testing.assert_allclose(rows, reference.image_rows(image.pixels), atol=1e-5)


@pytest.mark.parametrize(
    "chunk, scored", [(5, True), (None, True), (None, False)], ids=["chunks", "groups", "plain"]
)
def test_images_and_text_batched_against_transformers(
    served: tuple[LoadedModel, QwenReference], chunk: int | None, scored: bool
) -> None:
    """Chunks of 5: each prompt with images is cut inside an image and after it (a chunk of
    text alone, its positions moved by the image before it); whole prompts: image and text
    prompts prefill in one left-padded group. Every answer decodes in one batch with the text
    prompt's, 8 tokens each: the image rows' positions are their cache offsets plus their
    deltas, the text row's its offset."""
    model, reference = served
    one, first = image_prompt(model, "What is in this picture?", [picture(3)])
    two, both = image_prompt(model, "Compare them.", [picture(4, 60, 40), picture(5, 30, 120)])
    text = list(model.tokenizer.encode("A plain text prompt about nothing in particular"))
    recs = run_requests(
        engine_of(model, prefill_chunk=chunk),
        [
            EngineRequest("one", one, params(8, scored), stream=True, images=first),
            EngineRequest("txt", text, params(8, scored), stream=True),
            EngineRequest("two", two, params(8, scored), stream=True, images=both),
        ],
    )
    for rec, images in zip(recs, [first, (), both]):
        assert rec.error is None and len(rec.output_ids) == 8
        check(rec, reference.logprobs(rec.prompt_ids + list(rec.output_ids), images))


def test_second_turn_from_the_prefix_cache_batched_with_text(
    served: tuple[LoadedModel, QwenReference],
) -> None:
    """A conversation's second turn about an image takes the first turn's keys and values
    (its answer's among them, computed at the moved positions) from the prefix cache, with a
    text request in the same batch; the encoder is not run again."""
    model, reference = served
    ids, images = image_prompt(model, "Describe it.", [picture(6)])
    engine = engine_of(model)
    vision = engine.runner.prefill.vision
    assert isinstance(vision, ImageEmbedder)
    more = list(model.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd the colours?"))
    text = list(model.tokenizer.encode("Some text of another request"))
    client = client_of(engine)

    async def conversation() -> list[Record]:
        a = EngineRequest("a", ids, params(6, False), stream=True, images=images)
        first = Record(a, (await collect_outputs(client, a))[0])
        turn = ids + list(first.output_ids) + more
        b = EngineRequest("b", turn, params(6, False), stream=True, images=images)
        t = EngineRequest("t", text, params(6, True), stream=True)
        outs = await asyncio.gather(collect_outputs(client, b), collect_outputs(client, t))
        return [first, Record(b, outs[0][0]), Record(t, outs[1][0])]

    try:
        first, second, other = asyncio.run(conversation())
    finally:
        client.shutdown()
    assert vision.encoded == 1
    assert first.cached_tokens == 0 and second.cached_tokens >= len(ids)
    check(first, reference.logprobs(ids + list(first.output_ids), images))
    check(second, reference.logprobs(second.prompt_ids + list(second.output_ids), images))
    check(other, reference.logprobs(text + list(other.output_ids)))


def test_choices_of_a_prompt_with_images(served: tuple[LoadedModel, QwenReference]) -> None:
    """n = 2 choices, prefilled once (the one-prompt path), the prompt's cache copied to a row
    per choice, each row's decode positions moved by the prompt's delta: every sampled entry
    against the reference."""
    model, reference = served
    ids, images = image_prompt(model, "Tell me about it.", [picture(8)])
    sp = SamplingParams(max_tokens=5, temperature=1.0, seed=7, logprobs=True, top_logprobs=5)
    req = EngineRequest("n", ids, sp, n=2, stream=True, images=images)
    client = client_of(engine_of(model))
    try:
        choices = asyncio.run(collect_outputs(client, req))
    finally:
        client.shutdown()
    assert len(choices) == 2
    for outs in choices:
        rec = Record(req, outs)
        assert rec.error is None and rec.store is not None
        ref = reference.logprobs(ids + list(rec.output_ids), images)
        for j, tok in enumerate(rec.output_ids):
            row = ref[len(ids) - 1 + j]
            assert abs(rec.store.logprobs[j] - row[tok]) < 1e-4
            _, lps = rec.store.top(j)
            np.testing.assert_allclose(np.array(lps), np.sort(row)[::-1][:5], atol=1e-4)


def test_an_mlx_vlm_directory(
    served: tuple[LoadedModel, QwenReference], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same model as mlx-vlm writes it (`language_model.model.`, `language_model.lm_head`,
    `vision_tower.` with the patch embedding in MLX's layout) with the hub's config (its text
    fields at the top): the same logits and rows."""
    model, _ = served
    out = tmp_path_factory.mktemp("mlx-vlm")
    for f in model.path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    named = {}
    for k, v in mx.load(str(model.path / "model.safetensors")).items():  # type: ignore[union-attr]
        k = k.removeprefix("model.")
        if k.startswith("visual."):
            k = "vision_tower." + k.removeprefix("visual.")
            v = v.transpose(0, 2, 3, 4, 1) if k.endswith("patch_embed.proj.weight") else v
        elif k.startswith("lm_head."):
            k = "language_model." + k
        else:
            k = "language_model.model." + k.removeprefix("language_model.")
        named[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), named)
    # the config as the hub's checkpoints (and mlx-vlm's conversions of them) have it: the
    # text model's fields at the top, its sections under `rope_scaling` of type `mrope`
    config = json.loads((out / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    config.update(text, rope_theta=rope["rope_theta"])
    config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (out / "config.json").write_text(json.dumps(config))
    again = load_model(str(out))
    ids, images = image_prompt(model, "Same?", [picture(7)])
    probe = mx.array([model.tokenizer.encode("a text of a dozen tokens or so, to rotate far")])
    close = {"rtol": 0, "atol": 1e-5}
    np.testing.assert_allclose(np.array(again.model(probe)), np.array(model.model(probe)), **close)
    a, b = encoder_of(model.model), encoder_of(again.model)
    assert a is not None and b is not None
    np.testing.assert_allclose(
        np.array(a(images[0].pixels)), np.array(b(images[0].pixels)), **close
    )
