"""vLLM's multimodal `features` on the token routes (prime-rl's and SkyRL's render-then-generate):
the render route answers a prompt's expanded ids with each image's hash and placeholder range;
`/inference/v1/generate` takes them back with the ids. The images are those this server read for
the model (api/core/kept_images.py): a hash it never read, or one long out of its keeping, is a
400 that says to render the prompt again. Every range is checked against the ids (the image's
placeholder count, the image token at each of its places, no image token outside one)."""

from __future__ import annotations

from typing import Any

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.kept_images import placed, positions, span
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.rl.protocol import MultiModalFeatures
from omlx_logprobs.types import ImageInput

__all__ = ["features_json", "images_of"]

IMAGE = "image"  # vLLM's modality name


def features_json(images: tuple[ImageInput, ...]) -> dict[str, Any] | None:
    """The render route's `features` of a prompt's images (None without images): metadata
    only, vLLM's shape for items the generate side holds (`kwargs_data` null)."""
    if not images:
        return None
    ranges = [span(i) for i in images]
    return {
        "mm_hashes": {IMAGE: [i.digest for i in images]},
        "mm_placeholders": {IMAGE: [{"offset": o, "length": n} for o, n in ranges]},
        "kwargs_data": None,
    }


def images_of(
    features: MultiModalFeatures | None, ids: list[int], served: Served
) -> tuple[ImageInput, ...]:
    """The images `features` names, placed where its ranges say; a 400 naming the field."""
    vision = served.model.vision
    if features is None:
        if vision is not None:  # an image's placeholders without the image: not text either
            _no_strays(ids, set(), vision.image_token_id)
        return ()
    if vision is None:
        raise APIError(
            f"features: the model {served.model.name!r} takes no images", param="features"
        )
    for field in ("mm_hashes", "mm_placeholders"):
        other = set(getattr(features, field)) - {IMAGE}
        if other:
            raise APIError(
                f"features.{field}: only images are taken, not {sorted(other)}",
                param=f"features.{field}",
            )
    hashes = features.mm_hashes.get(IMAGE, [])
    ranges = features.mm_placeholders.get(IMAGE, [])
    if len(hashes) != len(ranges):
        raise APIError(
            f"features: {len(hashes)} image hashes for {len(ranges)} placeholder ranges",
            param="features.mm_placeholders",
        )
    limit = served.limits.max_images
    if len(hashes) > limit:
        raise APIError(
            f"{len(hashes)} images, more than --max-images ({limit})",
            param=f"features.mm_hashes.image[{limit}]",
        )
    images: list[ImageInput] = []
    taken: set[int] = set()
    for i, (digest, r) in enumerate(zip(hashes, ranges)):
        kept = served.kept_images.get(digest)
        if kept is None:
            raise APIError(
                f"features.mm_hashes.image[{i}]: no image with this hash is kept by this"
                " server; render the prompt on it first (POST /v1/chat/completions/render)",
                param=f"features.mm_hashes.image[{i}]",
            )
        image = placed(kept, r.offset)
        where = f"features.mm_placeholders.image[{i}]"
        if span(image) != (r.offset, r.length):
            raise APIError(
                f"{where}: the image takes {span(image)[1]} placeholder tokens, not {r.length}",
                param=where,
            )
        at = positions(image)
        if at[-1] >= len(ids) or any(ids[p] != vision.image_token_id for p in at):
            raise APIError(
                f"{where}: token_ids[{r.offset}:{r.offset + r.length}] are not all the image"
                f" token ({vision.image_token_id})",
                param=where,
            )
        if taken.intersection(at) or (images and r.offset < span(images[-1])[0]):
            raise APIError(f"{where}: the ranges must be in order, apart", param=where)
        taken.update(at)
        images.append(image)
    _no_strays(ids, taken, vision.image_token_id)
    return tuple(images)


def _no_strays(ids: list[int], taken: set[int], image_token: int) -> None:
    stray = next((p for p, t in enumerate(ids) if t == image_token and p not in taken), None)
    if stray is not None:
        raise APIError(
            f"token_ids[{stray}] is the image token outside every image's placeholder range"
            " (features)",
            param="token_ids",
        )
