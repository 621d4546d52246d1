"""A prompt's images into its prefill: each image's rows of input embeddings, computed by the
vision encoder (models/vision.py) once per image content and kept by its hash (bounded, least
recently used first out), put at the image's placeholder tokens in place of their token
embeddings. Prefill asks for the input embeddings of a forward's rows (`inputs`): a
left-padded group of whole prompts, or one chunk of one prompt, which may cut an image (its
rows then go half to each chunk). An image's rows fill its runs of placeholder tokens in order
(one run, or several with the processor's tokens between them: Idefics3's tiles). Where the
encoder's images attend to each other both ways (Gemma 3's), the forward also takes each
position's run (`blocks`).

A family with multimodal rotary positions (Qwen's M-RoPE, models/vision_qwen.py) is also
given each column's positions in such a forward (`positions`), and each row's decode positions
are moved by its prompt's delta once it is prefilled (`shift`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.models.vision import Encoder, encoder_of
from omlx_logprobs.runner.batch_cache import BatchCache, leaves
from omlx_logprobs.types import ImageInput

__all__ = ["ImageEmbedder"]

FEATURES_MIB = 256  # the encoder's outputs kept, by image hash


class ImageEmbedder:
    def __init__(self, encoder: Encoder, embed: Any, budget: int = FEATURES_MIB << 20) -> None:
        """`embed`: the text model's token embedding (ids -> [B, L, hidden]), as its first
        layer reads it."""
        self.encoder = encoder
        self.embed = embed
        self.budget = budget
        self._kept: OrderedDict[str, mx.array] = OrderedDict()
        self._bytes = 0
        self.encoded = 0  # images run through the encoder (a kept one is not run again)

    @staticmethod
    def of(model: Any) -> ImageEmbedder | None:
        """The embedder of a vision model's text half, None for a text model."""
        encoder = encoder_of(model)
        if encoder is None:
            return None
        for path in (("language_model", "model"), ("model",)):
            body = model
            for name in path:
                body = getattr(body, name, None)
            if body is not None and hasattr(body, "embed_tokens"):
                # A body that scales its token embeddings in its forward (Gemma's) takes input
                # embeddings scaled already: its `embed_inputs`
                return ImageEmbedder(encoder, getattr(body, "embed_inputs", body.embed_tokens))
        raise ValueError("a vision model whose text half has no token embedding to extend")

    def new_weights(self, weights: dict[str, mx.array]) -> Callable[[], None] | None:
        """The encoder's update from a checkpoint's arrays, checked (a ValueError naming the
        first that does not fit), to apply once the text model's are in: its kept rows go
        with the old weights; None when the checkpoint holds none of the encoder's."""
        put = self.encoder.new_weights(weights)
        if put is None:
            return None

        def apply() -> None:
            put()
            self._kept.clear()
            self._bytes = 0

        return apply

    def features(self, image: ImageInput) -> mx.array:
        """The image's rows [length, hidden] (a deepstack family's [1 + k, length, hidden]):
        kept ones by hash, else encoded (evaluated here: what is kept is counted in bytes)."""
        kept = self._kept.get(image.digest)
        if kept is not None:
            self._kept.move_to_end(image.digest)
            return kept
        rows = self.encoder(image.pixels)
        if rows.shape[-2] != image.length:
            raise ValueError(
                f"the image's encoder gave {rows.shape[-2]} rows for {image.length} placeholder"
                " tokens"
            )
        mx.eval(rows)
        self.encoded += 1
        self._kept[image.digest] = rows
        self._bytes += rows.nbytes
        while self._bytes > self.budget and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.nbytes
        return rows

    def inputs(self, ids: mx.array, rows: list[tuple[Sequence, int]]) -> dict[str, mx.array]:
        """The forward's keyword arguments for `ids` [B, L]: the input embeddings [B, L,
        hidden] with the rows of the images there (none where no image is), a deepstack
        family's rows for its first layers [k, B, L, hidden] (zeros but at the images), a
        family's multimodal positions (`positions`) and Gemma 3's image blocks (`blocks`).
        `rows`: each row's sequence and the prompt position of its column 0 (negative in a
        left-padded row: its padding is before position 0)."""
        width = ids.shape[1]
        out = self.positions(width, rows)
        placed = [
            (r, shift, image, start, n, row)
            for r, (seq, shift) in enumerate(rows)
            for image in seq.images
            if image.start < shift + width and image.end > shift
            for start, n, row in image.placed()
            if start < shift + width and start + n > shift
        ]
        if not placed:
            return out
        h = self.embed(ids)
        deep: mx.array | None = None
        for r, shift, image, start, n, row in placed:
            a, b = max(start, shift), min(start + n, shift + width)
            rows_ = self.features(image)[..., row + a - start : row + b - start, :]
            if rows_.ndim == 3:  # the rows, then each deepstack layer's
                if deep is None:
                    deep = mx.zeros((rows_.shape[0] - 1, *h.shape), h.dtype)
                deep[:, r, a - shift : b - shift, :] = rows_[1:].astype(h.dtype)
                rows_ = rows_[0]
            h[r, a - shift : b - shift, :] = rows_.astype(h.dtype)
        out["input_embeddings"] = h
        if deep is not None:
            out["deepstack"] = deep
        blocks = self.blocks(width, rows)  # Gemma 3's images attend both ways
        if blocks is not None:
            out["image_blocks"] = blocks
        return out

    def positions(self, width: int, rows: list[tuple[Sequence, int]]) -> dict[str, mx.array]:
        """The forward's `position_ids` [3, B, width] for a family with multimodal rotary
        positions (each row's from its prompt's images; a padding column's are 0, masked),
        else none. `rows` as for `inputs`."""
        of = self.encoder.positions
        if of is None:
            return {}
        out = np.zeros((3, len(rows), width), np.int64)
        for r, (seq, shift) in enumerate(rows):
            n = min(shift + width, len(seq.context_ids))
            a = max(shift, 0)
            out[:, r, a - shift : n - shift] = of(seq.images, n)[:, a:n]
        return {"position_ids": mx.array(out)}

    def shift(self, cache: BatchCache, rows: list[tuple[int, Sequence, int]]) -> None:
        """After a prefill, move the decode positions of these (row, sequence, tokens in its
        cache) by their prompts' deltas (a family with multimodal rotary positions; its
        layers' plain keys and values: mlx-lm's rotation reads each row's position there)."""
        if self.encoder.positions is None:
            return
        deltas = [0] * len(cache)
        for row, seq, n in rows:
            if seq.images:
                pos = self.encoder.positions(seq.images, n)
                deltas[row] = int(pos.max()) + 1 - n
        if any(deltas):
            moved = mx.array(deltas)
            for c in leaves(cache.layers):
                if type(c) is BatchKVCache:
                    c.offset = c.offset + moved

    def blocks(self, width: int, rows: list[tuple[Sequence, int]]) -> mx.array | None:
        """[B, width] int32: each position's run of placeholders (numbered in the forward),
        -1 for text; None where the encoder's images attend causally, as text does. `rows` as
        `inputs` takes them."""
        if not self.encoder.bidirectional:
            return None
        out = np.full((len(rows), width), -1, np.int32)
        block = 0
        for r, (seq, shift) in enumerate(rows):
            for image in seq.images:
                for start, n, _ in image.placed():
                    a, b = max(start, shift), min(start + n, shift + width)
                    if a < b:
                        out[r, a - shift : b - shift] = block
                        block += 1
        return mx.array(out)
