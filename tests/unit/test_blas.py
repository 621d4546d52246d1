"""The process environment MLX runs in: OpenBLAS must win over mlx[cpu]'s reference BLAS wherever
it is installed (40x on matmuls); numpy's own OpenBLAS computes on one thread beside it; the
server bounds MLX's CUDA graph cache."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import pytest

import omlx_logprobs
from omlx_logprobs.blas import numpy_blas_threads
from omlx_logprobs.cli import MLX_ENVIRONMENT, mlx_environment


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_openblas_is_in_use_when_installed() -> None:
    if not ctypes.util.find_library("openblas"):
        pytest.skip("no OpenBLAS on this machine")
    assert omlx_logprobs.BLAS.startswith("OpenBLAS"), omlx_logprobs.BLAS


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_numpy_blas_set_to_one_thread() -> None:
    import numpy

    site = os.path.dirname(os.path.dirname(numpy.__file__))
    libs = glob.glob(os.path.join(site, "numpy.libs", "*openblas*"))
    if not libs:
        pytest.skip("this numpy bundles no OpenBLAS")
    get = getattr(ctypes.CDLL(libs[0]), "scipy_openblas_get_num_threads64_", None)
    if get is None:
        pytest.skip("an OpenBLAS build of other symbol names")
    try:
        assert numpy_blas_threads(2) and get() == 2
        assert numpy_blas_threads(1) and get() == 1
    finally:
        numpy_blas_threads(1)  # as the engine leaves it on the CPU (runner/query_blocks.py)


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
