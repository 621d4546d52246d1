"""A sample's prompt, the SDK's ModelInput, as the engine takes it: its text chunks' ids and its
images. An image chunk (`ImageChunk`: the image's bytes; `ImageAssetPointerChunk`: its file or
URL, read as a chat's image URL is) is read and checked as every route's images are
(api/core/images.py and api/core/prompts.py: a 400 for a corrupt image, one past
--max-image-pixels, more than --max-images, an image to a model that reads text only). It stands
for the image's placeholder tokens as the model's processor expands that image alone, the tokens
between its runs with them (Idefics3's tile markers, Pixtral's row breaks); the tokens a family
writes around an image (Qwen's `<|vision_start|>` and `<|vision_end|>`, as tinker-cookbook's
Qwen3-VL renderer writes them; Gemma 3's start and end of image) are the text chunks'. Its
`expected_tokens`, when given, must be that count: the positions the chunk takes in the prompt,
which the SDK's `ModelInput.length` counts."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from tinker import types

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import data_url, expand_chunks, location_url
from omlx_logprobs.api.core.kept_images import span
from omlx_logprobs.api.core.prompts import read_images
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.types import ImageInput

__all__ = ["Picture", "Prompt", "parse"]


@dataclass(frozen=True)
class Picture:
    """An image chunk: its index among the prompt's chunks, its URL, its `expected_tokens`,
    and the chunk's field the URL came from (`data`, `location`)."""

    index: int
    url: str
    expected: int | None
    source: str

    @property
    def field(self) -> str:
        return f"prompt.chunks[{self.index}]"


@dataclass(frozen=True)
class Prompt:
    """The chunks in order: a text chunk's ids, or an image."""

    parts: tuple[list[int] | Picture, ...]

    @property
    def pictures(self) -> list[Picture]:
        return [p for p in self.parts if isinstance(p, Picture)]

    def text_ids(self) -> list[int]:
        """The ids of a prompt without images."""
        assert not self.pictures
        return [t for p in self.parts if not isinstance(p, Picture) for t in p]

    def expanded(self, served: Served) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's ids with each image's placeholders, and its images on them; a 400
        naming the chunk that does not fit. Reads and decodes the images: off the event loop."""
        vision = served.model.vision
        if not self.pictures:
            ids = self.text_ids()
            if vision is not None and vision.image_token_id in ids:
                at = ids.index(vision.image_token_id)
                raise APIError(
                    f"prompt: token {at} is the image token ({vision.image_token_id}) and no"
                    " image chunk stands there (send the image as an ImageChunk)",
                    param="prompt",
                )
            return ids, ()
        pictures = self.pictures
        parts = [(p.field, f"{p.field}.{p.source}", p.url) for p in pictures]
        images = iter(read_images(served.model, served.limits, parts))
        assert vision is not None  # read_images refuses images to a text model
        ids, inputs = expand_chunks(
            vision, [next(images) if isinstance(p, Picture) else p for p in self.parts]
        )
        for p, image in zip(pictures, inputs):
            n = span(image)[1]
            if p.expected is not None and p.expected != n:
                raise APIError(
                    f"{p.field}.expected_tokens is {p.expected}, but the image takes {n} tokens"
                    f" on the model {served.model.name!r} (its placeholders as the model's"
                    " processor expands it)",
                    param=f"{p.field}.expected_tokens",
                )
        return ids, inputs


def parse(prompt: types.ModelInput) -> Prompt:
    """The prompt's chunks; a 400 for a chunk that is neither text nor an image, a negative id,
    or neither a token nor an image."""
    parts: list[list[int] | Picture] = []
    for i, chunk in enumerate(prompt.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            parts.append([int(t) for t in chunk.tokens])
        elif isinstance(chunk, types.ImageChunk):
            b64 = base64.b64encode(chunk.data).decode()
            parts.append(Picture(i, data_url(f"image/{chunk.format}", b64, f"prompt.chunks[{i}]"),
                                 chunk.expected_tokens, "data"))  # fmt: skip
        elif isinstance(chunk, types.ImageAssetPointerChunk):
            url = location_url(chunk.location, f"prompt.chunks[{i}].location")
            parts.append(Picture(i, url, chunk.expected_tokens, "location"))
        else:
            raise APIError(
                f"prompt.chunks[{i}]: only encoded_text and image chunks are served, not"
                f" {chunk.type!r}",
                param=f"prompt.chunks[{i}]",
            )
    ids = [t for p in parts if not isinstance(p, Picture) for t in p]
    images = any(isinstance(p, Picture) for p in parts)
    if (not ids and not images) or (ids and min(ids) < 0):
        raise APIError("the prompt must hold at least one token id, none negative",
                       param="prompt")  # fmt: skip
    return Prompt(tuple(parts))
