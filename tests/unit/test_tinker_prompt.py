"""A Tinker sample's prompt (api/tinker/prompt.py) on the tiny Qwen3-VL's processor: text and
image chunks to the prompt's ids and images, an image asset read from an allowed folder, and each
refusal a 400 naming the chunk (another kind of chunk, a relative path, more than --max-images,
past --max-image-pixels, a wrong expected_tokens, an image to a model that reads text only)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")  # it needs Python 3.11 (pyproject.toml)
from tinker import types  # noqa: E402

from omlx_logprobs.api.core.errors import APIError  # noqa: E402
from omlx_logprobs.api.tinker.prompt import parse  # noqa: E402
from omlx_logprobs.config import Limits  # noqa: E402
from omlx_logprobs.models.loader import LoadedModel, load_model  # noqa: E402
from tests.helpers.qwen_vl import tiny_qwen_vl_dir  # noqa: E402
from tests.helpers.vision import picture, png_bytes  # noqa: E402

PNG = png_bytes(picture(1))  # 40 x 60: 6 placeholders


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LoadedModel:
    path = tiny_qwen_vl_dir(tmp_path_factory.mktemp("qwen3_vl"), tokenizer_dir, "qwen3_vl")
    return load_model(str(path), weights=False)


def served(model: Any, **limits: Any) -> Any:
    return SimpleNamespace(model=model, limits=Limits(**limits))


def prompt(*chunks: Any) -> types.ModelInput:
    return types.ModelInput(chunks=list(chunks))


def text(*ids: int) -> types.EncodedTextChunk:
    return types.EncodedTextChunk(tokens=list(ids))


def refused(p: types.ModelInput, on: Any, param: str, says: str) -> None:
    with pytest.raises(APIError) as e:
        parse(p).expanded(on)
    assert e.value.param == param and says in e.value.message, e.value.message


def test_text_and_image_chunks(qwen: LoadedModel, tmp_path: Path) -> None:
    assert qwen.vision is not None
    pad = qwen.vision.image_token_id
    image = types.ImageChunk(data=PNG, format="png", expected_tokens=6)
    ids, images = parse(prompt(text(5, 6), image, text(7))).expanded(served(qwen))
    assert ids == [5, 6, *[pad] * 6, 7]
    assert [(i.start, i.end) for i in images] == [(2, 8)]
    (tmp_path / "a.png").write_bytes(PNG)
    asset = types.ImageAssetPointerChunk(format="png", location=str(tmp_path / "a.png"))
    on = served(qwen, allowed_local_media_path=str(tmp_path))
    again, same = parse(prompt(text(5, 6), asset, text(7))).expanded(on)
    assert again == ids and same[0].digest == images[0].digest
    assert parse(prompt(text(5), text(6))).expanded(served(qwen)) == ([5, 6], ())


def test_refusals(qwen: LoadedModel, tiny: LoadedModel) -> None:
    image = types.ImageChunk(data=PNG, format="png")
    with pytest.raises(APIError, match="not 'dmel'"):
        parse(prompt(text(5), types.DmelChunk(dmel=b"\x00")))
    with pytest.raises(APIError, match="at least one token"):
        parse(prompt(text()))
    with pytest.raises(APIError, match="must be absolute"):
        parse(prompt(types.ImageAssetPointerChunk(format="png", location="a.png")))
    refused(prompt(text(5), image, image), served(qwen, max_images=1), "prompt.chunks[2]",
            "more than --max-images (1)")  # fmt: skip
    refused(prompt(text(5), image), served(qwen, max_image_pixels=100),
            "prompt.chunks[1].data", "--max-image-pixels")  # fmt: skip
    corrupt = types.ImageChunk(data=PNG[:60], format="png")
    refused(prompt(text(5), corrupt), served(qwen), "prompt.chunks[1].data", "")
    wrong = types.ImageChunk(data=PNG, format="png", expected_tokens=4)
    refused(prompt(text(5), wrong), served(qwen), "prompt.chunks[1].expected_tokens",
            "expected_tokens is 4, but the image takes 6 tokens")  # fmt: skip
    refused(prompt(text(5), image), served(tiny), "prompt.chunks[1]", "takes no images")
    assert qwen.vision is not None
    refused(prompt(text(5, qwen.vision.image_token_id)), served(qwen), "prompt",
            "no image chunk stands there")  # fmt: skip
