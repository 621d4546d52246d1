"""Routed experts on the wire (docs/specs/rl.md): vLLM's and SGLang's `return_routed_experts`
and the routing a request gives to replay.

A choice's routing goes out as vLLM sends it, `routed_experts` on the choice: the base64 of a
NumPy `.npy` file holding its int16 array [positions, moe_layers, top_k] (the file's header
carries the shape and dtype: `np.load(io.BytesIO(base64.b64decode(s)))`), on its final output.
A request's own `routed_experts` (no server has a standard field for it: this is ours) is a
routing to replay on its prompt's first positions, in the same encoding or as nested lists; the
model's forward uses those experts there instead of its router's choice (runner/routing.py).
Both are 400s on a model whose routing is not recorded (a dense model, a family not known, a
model split over processes).
`--enable-return-routed-experts` (vLLM's flag) makes every request on a model whose routing is
recorded ask."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import replace
from typing import Any

import numpy as np

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.types import RequestOutput, SamplingParams

__all__ = ["decode", "encode", "routed_experts_json", "with_routing"]


def encode(routes: np.ndarray) -> str:
    """The base64 of an `.npy` file of `routes` (vLLM's encoding of `routed_experts`)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(routes), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode(value: str | list[Any]) -> np.ndarray:
    """A routing as a request sends it: `encode`'s string, or nested lists of ids."""
    if isinstance(value, str):
        try:
            arr = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
        except (ValueError, OSError, binascii.Error, EOFError) as e:
            raise APIError(
                f"routed_experts is not the base64 of a .npy file: {e}", param="routed_experts"
            ) from e
    else:
        try:
            arr = np.array(value)
        except ValueError as e:
            raise APIError(f"routed_experts is not an array: {e}", param="routed_experts") from e
    if arr.dtype.kind not in "iu":
        raise APIError("routed_experts must hold integer expert ids", param="routed_experts")
    return arr


def routed_experts_json(out: RequestOutput) -> str:
    """`,"routed_experts":...` for a choice's output that carries its routing, else ""."""
    if out.routed_experts is None:
        return ""
    return f',"routed_experts":"{encode(out.routed_experts)}"'


def with_routing(
    req: Any, served: Any, prompt_len: int, params: SamplingParams
) -> tuple[SamplingParams, np.ndarray | None]:
    """The request's `return_routed_experts` in its params, and its routing to replay checked
    against the model's routing shape and its prompt (`served`: api/core/served.Served)."""
    # A model split over processes (rank 0 of a group: cfg.parallel set) records nothing: its
    # other ranks would route a replayed prompt their own way (ModelRunner.routes).
    split = served.cfg.parallel is not None
    shape = None if split else served.checks.bounds.routing
    asked = bool(getattr(req, "return_routed_experts", False))
    asked |= served.cfg.return_routed_experts and shape is not None  # the server's flag
    given = getattr(req, "routed_experts", None)
    if not asked and given is None:
        return params, None
    if shape is None:
        field = "return_routed_experts" if asked else "routed_experts"
        why = (
            "is split over processes (routing is recorded on one process only)"
            if split
            else "is not one"
        )
        raise APIError(
            f"{field} needs a mixture-of-experts model whose routing this server records"
            f" (qwen3_moe, qwen2_moe, mixtral); `{served.model.name}` {why}",
            param=field,
        )
    params = replace(params, return_routed_experts=asked)
    if given is None:
        return params, None
    arr = decode(given)
    want = f"[n, {shape.layers}, {shape.top_k}] with n at most the prompt's {prompt_len} tokens"
    if arr.ndim != 3 or arr.shape[1:] != (shape.layers, shape.top_k) or arr.shape[0] > prompt_len:
        raise APIError(
            f"routed_experts has shape {list(arr.shape)}; this model takes {want}",
            param="routed_experts",
        )
    if arr.size and (arr.min() < 0 or arr.max() >= shape.experts):
        raise APIError(
            f"routed_experts holds an expert id outside [0, {shape.experts})",
            param="routed_experts",
        )
    if arr.size and (np.diff(np.sort(arr, axis=-1), axis=-1) == 0).any():
        raise APIError(
            "routed_experts routes a token to the same expert twice in one layer",
            param="routed_experts",
        )
    return params, arr.astype(np.int16)
