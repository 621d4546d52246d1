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
import time
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
    "expand_chunks",
    "image_part",
    "image_parts",
    "placed_in",
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
    """The URL's bytes within image_fetch_s in all, not only between two reads (a server that
    dribbles a byte at a time runs out of it too: checked as bytes arrive, so a fetch ends by
    twice the limit at worst), at most max_body_bytes. Run off the event loop (prepare.py)."""
    cap, deadline = limits.max_body_bytes, time.monotonic() + limits.image_fetch_s
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=limits.image_fetch_s) as r:  # noqa: S310
            while len(data) <= cap:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not fetched within {limits.image_fetch_s:g} s")
                chunk = r.read1(cap + 1 - len(data))
                if not chunk:
                    break
                data += chunk
    except Exception as e:  # unreachable, refused, timed out: the client's URL
        raise APIError(f"{param}: the image could not be fetched: {e}", param=param) from None
    if len(data) > cap:
        raise APIError(f"{param}: the image is larger than --max-body-bytes", param=param)
    return bytes(data)


def expand(
    spec: VisionSpec,
    text: str,
    images: list[Image],
    special: bool,
    spliced: list[int] | None = None,
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt's ids with each image's placeholder tokens expanded (the processor's own
    expansion), and each image's pixel values and runs of placeholders. Each image goes through
    the processor alone too: its pixel values, how many placeholders it takes (two images side
    by side make one run of placeholders) and what lies from its first to its last (one run;
    Idefics3's tiles, each a run after its row and column marker), which its place in the
    prompt must repeat. `spliced`: the text's ids already, earlier answers in them as their
    sampled ids (api/core/splice.py), one image token an image: each is replaced by its image's
    expansion alone (the processor's pass over the whole text would tokenize the answers from
    their text). Where the processor writes a text for an image (`VisionSpec.expansion`),
    `spliced` are the ids of the text so expanded already."""
    alone = _alone(spec, images)
    if spliced is not None and spec.expansion is not None:
        ids = spliced
    elif spliced is not None:
        ids = _substituted(spliced, spec.image_token_id, [_ids(a) for a in alone])
    else:
        pictures = [i.picture for i in images]
        ids = _ids(_processed(spec, images, text=text, images=pictures, add_special_tokens=special))
    return ids, _placed(spec, ids, images, alone, "The chat template placed")


def expand_chunks(
    spec: VisionSpec, parts: list[list[int] | Image]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A prompt sent as token ids with images between them (Tinker's ModelInput: its text and
    image chunks): each image replaced by its placeholders as the processor expands it alone,
    from its first to its last, the tokens between its runs with them (Idefics3's tile
    markers, Pixtral's row breaks); the tokens a family writes around an image (Qwen's vision
    start and end, Gemma 3's start and end of image) are the text's, as the render route's
    range of an image leaves them (api/core/kept_images.py). The ids and the images on them."""
    images = [p for p in parts if isinstance(p, Image)]
    alone = _alone(spec, images)
    spans = iter(_span(spec, _ids(a)) for a in alone)
    ids: list[int] = []
    for p in parts:
        ids.extend(next(spans) if isinstance(p, Image) else p)
    return ids, _placed(spec, ids, images, alone, "The prompt holds")


def _span(spec: VisionSpec, own: list[int]) -> list[int]:
    """One image's ids alone from its first placeholder to its last (none: no placeholder,
    which `_placed` refuses)."""
    mine = [p for p, t in enumerate(own) if t == spec.image_token_id]
    return own[mine[0] : mine[-1] + 1] if mine else []


def placed_in(spec: VisionSpec, ids: list[int], images: list[Image]) -> tuple[ImageInput, ...]:
    """The images of a prompt whose ids the client sent, each image's placeholders already
    expanded in them as the processor expands them (the ids of /tokenize, of the render route
    and of the chat route's `prompt_token_ids`), found in order."""
    return _placed(spec, ids, images, _alone(spec, images), "The ids hold")


def _alone(spec: VisionSpec, images: list[Image]) -> list[Any]:
    """Each image through the processor alone: its pixel values and its placeholders."""
    token = spec.processor.image_token
    return [
        _processed(spec, [i], text=token, images=[i.picture], add_special_tokens=False)
        for i in images
    ]


def _processed(spec: VisionSpec, of: list[Image], **kwargs: Any) -> Any:
    """The processor's output; a 400 naming the first image of `of` when it fails."""
    try:
        return spec.processor(return_tensors="np", **kwargs)
    except Exception as e:  # the processor refuses this image (size, mode): the request's
        raise APIError(
            f"The model's processor could not read the images: {e}", param=of[0].param
        ) from None


def _placed(
    spec: VisionSpec, ids: list[int], images: list[Image], alone: list[Any], where: str
) -> tuple[ImageInput, ...]:
    """Each image's runs of placeholders in `ids`, in order, as its processor places them."""
    at = [p for p, t in enumerate(ids) if t == spec.image_token_id]
    owns = [_ids(a) for a in alone]
    counts = [own.count(spec.image_token_id) for own in owns]
    if len(at) != sum(counts) or 0 in counts:
        raise APIError(
            f"{where} {len(at)} image tokens for {len(images)} image(s) of {sum(counts)}",
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
        inputs.append(ImageInput(image.digest, _pixels(a), runs))
        first += n
    return tuple(inputs)


def _pixels(alone: Any) -> np.ndarray:
    """One image's pixel values; a processor that flattens its patches and gives their grid
    (Qwen's: [t * h * w, values], `image_grid_thw`) has them shaped by it, [1, t, h, w,
    values], so that the image carries its grid (models/vision_qwen.py)."""
    pixels = np.asarray(alone["pixel_values"], dtype=np.float32)
    grid = alone.get("image_grid_thw")
    if grid is None:
        return pixels
    t, h, w = (int(x) for x in np.asarray(grid)[0])
    return pixels.reshape(1, t, h, w, -1)


def _substituted(ids: list[int], token: int, expansions: list[list[int]]) -> list[int]:
    """`ids` with the k-th `token` replaced by the k-th expansion."""
    out: list[int] = []
    left = iter(expansions)
    for t in ids:
        out.extend(next(left) if t == token else (t,))
    return out


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


def location_url(location: str, param: str) -> str:
    """An image named by location (Tinker's image assets) as a URL: a URL as it is, an absolute
    path as a file's, read as every file URL is (only under --allowed-local-media-path); a
    relative path is a 400 naming `param`. Here because this is the one module of the HTTP
    layer that touches paths (tests/reliability/test_security.py)."""
    if "://" in location or location.startswith("data:"):
        return location
    if not Path(location).is_absolute():
        raise APIError(f"{param}: a path must be absolute, or a URL", param=param)
    return Path(location).as_uri()
