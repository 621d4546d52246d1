"""A chat request's images: read (data URLs; local files only under --allowed-local-media-path;
http(s) only with --allow-image-urls, bounded in bytes and time), checked (an image PIL can
decode, at most --max-image-pixels, at most --max-images per request), and put with the
prompt's text through the model's processor (models/vision.py): the prompt's ids with each
image's placeholder tokens expanded as the processor expands them, and each image's pixel values
(types.ImageInput). Every failure is a 400 naming the image's field."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.protocol import ChatMessage
from omlx_logprobs.config import Limits
from omlx_logprobs.models.vision import VisionSpec
from omlx_logprobs.types import ImageInput

__all__ = [
    "Image",
    "data_url",
    "expand",
    "image_part",
    "image_parts",
    "read_image",
    "template_content",
]


@dataclass(frozen=True)
class Image:
    """One decoded image (RGB) and the hash of its file's bytes."""

    picture: Any  # PIL.Image.Image
    digest: str
    param: str  # the request's field it came from, for the 400s


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str, str]]:
    """(the part's field, its image's field, url) of every image of the messages, in order:
    chat's own fields, or those of the API the part came from (`ImagePart.field`)."""
    out = []
    for i, m in enumerate(messages):
        for j, part in m.images():
            where = part.field or f"messages[{i}].content[{j}]"
            out.append((where, part.field or f"{where}.image_url", part.image_url.url))
    return out


def image_part(url: str, field: str) -> dict[str, Any]:
    """A chat image part of an image from another API's request (its `field`)."""
    return {"type": "image_url", "image_url": {"url": url}, "field": field}


def data_url(media_type: Any, data: Any, field: str) -> str:
    """A data URL of base64 data as another API sends it (Anthropic's source, Ollama's images)."""
    if not isinstance(data, str) or not data:
        raise APIError(f"{field}: an image's data must be a base64 string", param=field)
    kind = media_type if isinstance(media_type, str) and media_type else "image/*"
    return f"data:{kind};base64,{data}"


def template_content(m: ChatMessage) -> str | list[dict[str, Any]]:
    """A message's content as vision chat templates read it: its parts in order, an image as
    `{"type": "image"}` (where the template writes the image token)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    return [
        {"type": "text", "text": p.text} if p.type == "text" else {"type": "image"}
        for p in m.content
    ]


def read_image(url: str, param: str, limits: Limits) -> Image:
    """The image at `url`, decoded and checked; a 400 naming `param` otherwise."""
    data = _bytes(url, param, limits)
    from PIL import Image as PIL

    try:
        opened = PIL.open(io.BytesIO(data))
        width, height = opened.size
    except Exception as e:  # PIL cannot read it: a 400, not a 500
        raise APIError(f"{param} is not an image this server can read: {e}", param=param) from None
    if width * height > limits.max_image_pixels:
        raise APIError(
            f"{param} has {width}x{height} pixels, more than --max-image-pixels"
            f" ({limits.max_image_pixels})",
            param=param,
        )
    try:
        picture = opened.convert("RGB")  # decodes the whole image: a truncated one fails here
    except Exception as e:
        raise APIError(f"{param} could not be decoded: {e}", param=param) from None
    return Image(picture, hashlib.sha256(data).hexdigest(), param)


def _bytes(url: str, param: str, limits: Limits) -> bytes:
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise APIError(f"{param}: a data URL must be base64 (data:image/...;base64,...)", param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(f"{param}: the data URL's base64 is not valid", param=param) from None
    scheme = urlparse(url).scheme
    if scheme == "file":
        return _local(unquote(urlparse(url).path), param, limits)
    if scheme in ("http", "https"):
        if not limits.allow_image_urls:
            raise APIError(
                f"{param}: image URLs are not fetched by this server (start it with"
                " --allow-image-urls), send a data URL",
                param=param,
            )
        return _fetch(url, param, limits)
    raise APIError(f"{param}: an image URL must be a data, file or http(s) URL", param=param)


def _local(path: str, param: str, limits: Limits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise APIError(
            f"{param}: local files are not read by this server (start it with"
            " --allowed-local-media-path)",
            param=param,
        )
    target = Path(path).resolve()
    if not target.is_relative_to(Path(root).resolve()):
        raise APIError(f"{param}: the file is not under --allowed-local-media-path", param=param)
    try:
        with target.open("rb") as f:
            data = f.read(limits.max_body_bytes + 1)
    except OSError as e:
        raise APIError(f"{param}: the file could not be read: {e.strerror}", param=param) from None
    if len(data) > limits.max_body_bytes:
        raise APIError(f"{param}: the file is larger than --max-body-bytes", param=param)
    return data


def _fetch(url: str, param: str, limits: Limits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.image_fetch_s) as r:  # noqa: S310
            data = bytes(r.read(limits.max_body_bytes + 1))
    except Exception as e:  # unreachable, refused, timed out: the client's URL
        raise APIError(f"{param}: the image could not be fetched: {e}", param=param) from None
    if len(data) > limits.max_body_bytes:
        raise APIError(f"{param}: the image is larger than --max-body-bytes", param=param)
    return data


def expand(
    spec: VisionSpec, text: str, images: list[Image], special: bool
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's ids with each image's placeholder tokens expanded (the processor's own
    expansion), and each image's pixel values and runs of placeholders. Each image goes through
    the processor alone too: its pixel values, how many placeholders it takes (two images side
    by side make one run of placeholders) and what lies from its first to its last (one run;
    Idefics3's tiles, each a run after its row and column marker), which its place in the
    prompt must repeat."""
    processor = spec.processor
    try:
        ids = _ids(processor(text=text, images=[i.picture for i in images], return_tensors="np",
                             add_special_tokens=special))  # fmt: skip
        alone = [
            processor(text=processor.image_token, images=[i.picture], return_tensors="np")
            for i in images
        ]
    except Exception as e:  # the processor refuses this image (size, mode): the request's
        raise APIError(
            f"The model's processor could not read the images: {e}", param=images[0].param
        ) from None
    at = [p for p, t in enumerate(ids) if t == spec.image_token_id]
    owns = [_ids(a) for a in alone]
    counts = [own.count(spec.image_token_id) for own in owns]
    if len(at) != sum(counts) or 0 in counts:
        raise APIError(
            f"The chat template placed {len(at)} image tokens for {len(images)} image(s) of"
            f" {sum(counts)}",
            param=images[0].param,
        )
    inputs, first = [], 0
    for image, a, own, n in zip(images, alone, owns, counts):
        runs = _runs(at[first : first + n])
        mine = [p for p, t in enumerate(own) if t == spec.image_token_id]
        if ids[runs[0][0] : runs[-1][0] + runs[-1][1]] != own[mine[0] : mine[-1] + 1]:
            raise APIError(
                f"{image.param}: its image tokens are not as the processor places them",
                param=image.param,
            )
        pixels = np.asarray(a["pixel_values"], dtype=np.float32)
        inputs.append(ImageInput(image.digest, pixels, runs))
        first += n
    return ids, tuple(inputs)


def _runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """(start, count) of each run of consecutive positions."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return tuple(runs)


def _ids(out: Any) -> list[int]:
    return [int(t) for t in np.asarray(out["input_ids"])[0]]
