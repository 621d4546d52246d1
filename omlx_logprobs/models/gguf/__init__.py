"""GGUF files as mlx-lm model directories: tensors, metadata, architectures, tokenizer."""

from omlx_logprobs.models.gguf.convert import convert_gguf
from omlx_logprobs.models.gguf.tensors import read_tensor_types

__all__ = ["convert_gguf", "read_tensor_types"]
