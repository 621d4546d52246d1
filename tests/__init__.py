# Imported by pytest before any conftest: OpenBLAS must be loaded before the first `import mlx`.
import omlx_logprobs  # noqa: F401
