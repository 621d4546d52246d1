"""OpenBLAS must win over mlx[cpu]'s reference BLAS wherever it is installed (40x on matmuls)."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

import omlx_logprobs


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_openblas_is_in_use_when_installed() -> None:
    if not ctypes.util.find_library("openblas"):
        pytest.skip("no OpenBLAS on this machine")
    assert omlx_logprobs.BLAS.startswith("OpenBLAS"), omlx_logprobs.BLAS
