"""The process environment MLX runs in: OpenBLAS must win over mlx[cpu]'s reference BLAS wherever
it is installed (40x on matmuls); the server turns MLX's CUDA graphs off."""

from __future__ import annotations

import ctypes.util
import os
import sys

import pytest

import omlx_logprobs
from omlx_logprobs.cli import CUDA_GRAPHS_ENV, mlx_environment


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_openblas_is_in_use_when_installed() -> None:
    if not ctypes.util.find_library("openblas"):
        pytest.skip("no OpenBLAS on this machine")
    assert omlx_logprobs.BLAS.startswith("OpenBLAS"), omlx_logprobs.BLAS


def test_server_turns_mlx_cuda_graphs_off_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    mlx_environment()
    assert os.environ[CUDA_GRAPHS_ENV] == "0"
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "1")
    mlx_environment()
    assert os.environ[CUDA_GRAPHS_ENV] == "1"
