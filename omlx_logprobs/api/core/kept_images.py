"""The images a served model's requests brought, kept by content hash (bounded, least recently
used out), so that a token route can name one by its hash: vLLM's render route answers each
image's hash and placeholder range (`features`), and its `/inference/v1/generate` sends them back
with the prompt's ids (api/rl/features.py). What is kept is the processor's pixel values and
how many placeholders the image takes, not the file.

An image's placeholder positions and range, and an image moved to another place in a prompt,
are computed here alone (`positions`, `span`, `placed`): the only code of the token routes that
reads the shape of `types.ImageInput`'s runs of placeholders."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from omlx_logprobs.types import ImageInput

__all__ = ["KeptImages", "placed", "positions", "span"]

MAX_BYTES = 256 << 20  # pixel values kept per served model


def positions(image: ImageInput) -> list[int]:
    """The prompt positions of the image's placeholder tokens (not the processor's tokens
    between its runs: Idefics3's tile markers)."""
    return image.positions()


def span(image: ImageInput) -> tuple[int, int]:
    """The image's placeholder range in its prompt, as vLLM writes it: (offset, length), from
    its first placeholder to its last (the tokens between its runs within it)."""
    return image.start, image.end - image.start


def placed(image: ImageInput, offset: int) -> ImageInput:
    """The image with its placeholder range starting at `offset` of another prompt."""
    moved = tuple((start - image.start + offset, n) for start, n in image.runs)
    return replace(image, runs=moved)


class KeptImages:
    """Images by hash; thread-safe (requests with images are prepared in worker threads)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, ImageInput] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, images: tuple[ImageInput, ...]) -> None:
        with self._lock:
            for image in images:
                if image.digest in self._kept:
                    self._kept.move_to_end(image.digest)
                    continue
                self._kept[image.digest] = image
                self._bytes += image.pixels.nbytes
            while self._bytes > self.max_bytes and len(self._kept) > 1:
                _, out = self._kept.popitem(last=False)
                self._bytes -= out.pixels.nbytes

    def get(self, digest: str) -> ImageInput | None:
        with self._lock:
            found = self._kept.get(digest)
            if found is not None:
                self._kept.move_to_end(digest)
            return found
