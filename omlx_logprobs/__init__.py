"""omlx_logprobs: an OpenAI-compatible MLX server with exact, complete logprobs."""

# Must run before anything imports mlx: see blas.py.
from omlx_logprobs.blas import BLAS

__all__ = ["BLAS"]
__version__ = "0.1.0"
