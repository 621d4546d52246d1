"""Qwen2-VL's and Qwen2.5-VL's processor for images: transformers' `Qwen2VLProcessor` (which
Qwen2.5-VL's extends for videos only) without its video processor, which transformers builds
only with torchvision. Images expand as transformers expands them: the image processor's
patches, and `<|image_pad|>` once for each 2 x 2 block of them."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

__all__ = ["QwenImagesProcessor"]


class QwenImagesProcessor(Qwen2VLProcessor):
    # Its parts are those its __init__ names (transformers reads them from the signature):
    # the image processor and the tokenizer.
    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
