"""A request's images read and checked (api/core/images.py) and carried over from the other
APIs' shapes (Responses, Anthropic, Ollama): every refusal a 400 naming the image's field."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from omlx_logprobs.api.anthropic.convert import messages as anthropic_messages
from omlx_logprobs.api.anthropic.protocol import MessagesRequest
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import image_parts, read_image
from omlx_logprobs.api.ollama.convert import generate_request
from omlx_logprobs.api.ollama.protocol import OllamaGenerateRequest
from omlx_logprobs.api.responses.convert import input_messages
from omlx_logprobs.config import Limits
from tests.helpers.vision import picture, png_bytes

PNG = png_bytes(picture(1))  # 40x60
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def refused(url: str, limits: Limits, says: str) -> None:
    with pytest.raises(APIError) as e:
        read_image(url, "messages[0].content[0].image_url", limits)
    assert e.value.param == "messages[0].content[0].image_url"
    assert says in e.value.message


def test_a_data_url_is_read_and_hashed() -> None:
    image = read_image(URL, "x", Limits())
    assert image.picture.size == (40, 60) and image.picture.mode == "RGB"
    assert image.digest == read_image(URL, "y", Limits()).digest
    other = "data:image/png;base64," + base64.b64encode(png_bytes(picture(2))).decode()
    assert read_image(other, "x", Limits()).digest != image.digest


def test_refusals() -> None:
    refused("data:image/png;base64,####", Limits(), "base64")
    refused("data:image/png," + "x", Limits(), "base64")
    refused("data:image/png;base64," + base64.b64encode(b"GIF89a...").decode(), Limits(),
            "not an image")  # fmt: skip
    refused("data:image/png;base64," + base64.b64encode(PNG[:80]).decode(), Limits(), "")
    refused(URL, Limits(max_image_pixels=40 * 60 - 1), "40x60")
    refused("http://127.0.0.1:9/x.png", Limits(), "--allow-image-urls")
    refused("ftp://host/x.png", Limits(), "data, file or http(s)")
    refused("file:///etc/hostname", Limits(), "--allowed-local-media-path")


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", root / "link.png")
    limits = Limits(allowed_local_media_path=str(root))
    assert read_image((root / "a.png").as_uri(), "x", limits).picture.size == (40, 60)
    for escape in (f"file://{root}/../secret.png", (root / "link.png").as_uri()):
        refused(escape, limits, "not under --allowed-local-media-path")
    refused((root / "missing.png").as_uri(), limits, "could not be read")
    refused((root / "a.png").as_uri(), Limits(allowed_local_media_path=str(root),
                                               max_body_bytes=100), "larger")  # fmt: skip


def test_other_apis_images_name_their_own_fields() -> None:
    from omlx_logprobs.api.core.protocol import ChatMessage

    def parts(messages: list[dict]) -> list[tuple[str, str, str]]:  # type: ignore[type-arg]
        return image_parts([ChatMessage.model_validate(m) for m in messages])

    got = parts(input_messages([{"role": "user", "content": [
        {"type": "input_text", "text": "Look:"},
        {"type": "input_image", "image_url": URL},
    ]}]))  # fmt: skip
    assert got == [("input[0].content[1].image_url", "input[0].content[1].image_url", URL)]
    with pytest.raises(APIError, match="file_id"):
        input_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}])
    data = base64.b64encode(PNG).decode()
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
        ]}]})  # fmt: skip
    msgs = anthropic_messages(req)
    assert msgs[0]["content"][0] == {"type": "text", "text": "Look:"}
    assert parts(msgs) == [("messages[0].content[1].source",) * 2 + (URL,)]
    chat = generate_request(OllamaGenerateRequest(model="m", prompt="Look:", images=[data]))
    assert isinstance(chat.messages[0].content, list)  # type: ignore[union-attr]
    assert image_parts(chat.messages) == [("images[0]", "images[0]", "data:image/*;base64," + data)]  # type: ignore[union-attr]
    with pytest.raises(APIError, match="raw"):
        generate_request(OllamaGenerateRequest(model="m", prompt="x", raw=True, images=[data]))
