"""The process environment MLX runs in: OpenBLAS must win over mlx[cpu]'s reference BLAS wherever
it is installed (40x on matmuls); the server bounds MLX's CUDA graph cache."""

from __future__ import annotations

import ctypes.util
import os
import sys

import pytest

import omlx_logprobs
from omlx_logprobs.cli import MLX_ENVIRONMENT, mlx_environment


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_openblas_is_in_use_when_installed() -> None:
    if not ctypes.util.find_library("openblas"):
        pytest.skip("no OpenBLAS on this machine")
    assert omlx_logprobs.BLAS.startswith("OpenBLAS"), omlx_logprobs.BLAS


def test_server_sets_mlx_cuda_settings_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in MLX_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    mlx_environment()
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "0"
    assert os.environ["MLX_ENABLE_TF32"] == "0"
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "64"
    assert os.environ["MLX_CUDA_USE_CUDNN_SDPA"] == "1"  # long prefills bucketed (query_blocks)
    assert os.environ["MLX_CUDA_SDPA_CACHE_SIZE"] == "256"
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    monkeypatch.setenv("MLX_CUDA_GRAPH_CACHE_SIZE", "400")
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    mlx_environment()
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "400"
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "1"
