"""A prompt sent as ids with images between them (Tinker's image chunks, api/core/images.py's
`expand_chunks`), for every vision family: each image stands for its placeholders from its first
to its last, the tokens between its runs with them (Idefics3's tile markers, Pixtral's row
breaks), and what the family writes around them is the text's. Split where the processor's
expansion of a text with two images puts them, the chunks give back the same ids and the same
images (runs, pixel values, hashes)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import Image, expand, expand_chunks, read_image
from omlx_logprobs.api.core.kept_images import span
from omlx_logprobs.config import Limits
from omlx_logprobs.models.loader import load_model
from tests.helpers.gemma3 import tiny_gemma3_dir
from tests.helpers.idefics3 import tiny_idefics3_dir
from tests.helpers.pixtral import tiny_pixtral_dir
from tests.helpers.qwen_vl import tiny_qwen_vl_dir
from tests.helpers.vision import picture, png_bytes, tiny_llava_dir

BUILDERS: dict[str, Callable[[Path, Path], Path]] = {
    "llava": tiny_llava_dir,
    "idefics3": tiny_idefics3_dir,
    "gemma3": tiny_gemma3_dir,
    "mistral3": tiny_pixtral_dir,
    "qwen3_vl": lambda out, tok: tiny_qwen_vl_dir(out, tok, "qwen3_vl"),
}


def image(seed: int, field: str) -> Image:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(seed))).decode()
    return read_image(url, field, Limits())


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_chunks_give_the_processors_expansion(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    spec = load_model(str(BUILDERS[family](tmp_path, tokenizer_dir)), weights=False).vision
    assert spec is not None
    mark = spec.processor.image_token
    images = [image(1, "prompt.chunks[1]"), image(2, "prompt.chunks[3]")]
    ids, inputs = expand(spec, f"Look: {mark} and then {mark} here.", images, False)
    parts: list[Any] = []
    at = 0
    for img, inp in zip(images, inputs):
        parts += [ids[at : inp.start], img]
        at = inp.end
    parts.append(ids[at:])
    got, placed = expand_chunks(spec, parts)
    assert got == ids
    assert [(i.digest, i.runs) for i in placed] == [(i.digest, i.runs) for i in inputs]
    for a, b in zip(placed, inputs):
        np.testing.assert_array_equal(a.pixels, b.pixels)
    if family in ("idefics3", "mistral3"):  # text between an image's runs, inside its chunk
        assert len(inputs[0].runs) > 1
        assert span(inputs[0])[1] > sum(n for _, n in inputs[0].runs)
    # the image's token in the text where no image stands: refused, naming the first image
    with pytest.raises(APIError) as e:
        expand_chunks(spec, [[spec.image_token_id], *parts])
    assert e.value.param == "prompt.chunks[1]"
