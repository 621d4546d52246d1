"""omlx_logprobs: an OpenAI-compatible MLX server with exact, complete logprobs."""

# Must run before anything imports mlx: see blas.py and heap.py.
from omlx_logprobs.blas import BLAS
from omlx_logprobs.heap import HEAP

__all__ = ["BLAS", "HEAP"]
__version__ = "0.1.0"
