"""The compact logprobs form (`"logprobs_format": "columnar"` or `"base64"`): a block of entries
as five parallel arrays instead of an object per entry and per alternative, and its decoder.

A block, in JSON (`columnar`):

    {"token_ids": [int], "logprobs": [float], "ranks": [int],
     "top_ids": [[int] * k], "top_logprobs": [[float] * k]}

or with each array as base64 of its little-endian int32 / float32 bytes (`base64`), beside
`"n"` (positions) and `"k"` (alternatives per position), the top arrays row-major. A request
that asks for the tail mass (`return_tail_logprob`) gets one more array, `"tail_logprobs":
[float]` (float32 in base64): each position's log of the probability outside its alternatives.
A block holding a token the server forced instead of sampling (a thinking budget's closing tag)
has `"forced": [int]`, those positions in the block, in both encodings.

The numbers are the OpenAI shape's own: float32 logprobs (JSON writes the shortest digits that
read back as the same float32), a logprob of -inf as -9999.0 in both encodings.
A client reads it back into numpy with `decode_block`.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic_core import to_json

from omlx_logprobs.logprobs.format import NEG_INF_LOGPROB, NonFiniteLogprob, float32_decimals
from omlx_logprobs.types import Entries

Encoding = Literal["columnar", "base64"]
_NEG_INF = np.float32(float(NEG_INF_LOGPROB))


def _json(a: np.ndarray) -> str:
    """An int array (of any rank) as JSON."""
    return to_json(a.tolist()).decode()


def _json_logprobs(a: np.ndarray) -> str:
    """float32 logprobs (of any rank) as JSON, in the shortest digits that read back as the same
    float32, as the OpenAI shape's `float_numbers` writes them."""
    return to_json(float32_decimals(a).tolist()).decode()


def _b64(a: np.ndarray, dtype: str) -> str:
    return '"' + base64.b64encode(np.ascontiguousarray(a, dtype).tobytes()).decode() + '"'


def _wire_logprobs(a: np.ndarray) -> np.ndarray:
    """float32 logprobs as the OpenAI shape writes them: -inf as -9999.0, NaN refused."""
    a = np.asarray(a, np.float32)
    if np.isfinite(a).all():
        return a
    if np.isnan(a).any():
        raise NonFiniteLogprob("non-finite logprob nan")
    return np.where(np.isneginf(a), _NEG_INF, a)


def encode_block(e: Entries | None, k: int, encoding: Encoding) -> str:
    """The JSON object of these entries with their first `k` alternatives (an empty block for
    None)."""
    if e is None:
        e = Entries.empty(k)
    top_ids = np.asarray(e.top_ids)[:, :k]
    top_lps = _wire_logprobs(np.asarray(e.top_logprobs)[:, :k])
    lps = _wire_logprobs(e.logprobs)
    tail = None if e.tail is None else _wire_logprobs(e.tail)
    forced = "" if e.forced is None else f',"forced":{_json(np.flatnonzero(e.forced))}'
    if encoding == "base64":
        end = forced + ("" if tail is None else f',"tail_logprobs":{_b64(tail, "<f4")}')
        return (
            f'{{"n":{len(e)},"k":{top_ids.shape[1]},"token_ids":{_b64(e.token_ids, "<i4")},'
            f'"logprobs":{_b64(lps, "<f4")},"ranks":{_b64(e.ranks, "<i4")},'
            f'"top_ids":{_b64(top_ids, "<i4")},"top_logprobs":{_b64(top_lps, "<f4")}{end}}}'
        )
    end = forced + ("" if tail is None else f',"tail_logprobs":{_json_logprobs(tail)}')
    return (
        f'{{"token_ids":{_json(np.asarray(e.token_ids))},"logprobs":{_json_logprobs(lps)},'
        f'"ranks":{_json(np.asarray(e.ranks))},"top_ids":{_json(top_ids)},'
        f'"top_logprobs":{_json_logprobs(top_lps)}{end}}}'
    )


@dataclass(frozen=True)
class Block:
    """A decoded block: ids and ranks int32, logprobs float32 (the server's own values)."""

    token_ids: np.ndarray  # [n]
    logprobs: np.ndarray  # [n]
    ranks: np.ndarray  # [n]
    top_ids: np.ndarray  # [n, k]
    top_logprobs: np.ndarray  # [n, k]
    tail: np.ndarray | None = None  # [n]: `tail_logprobs`, when the request asked for them
    forced: tuple[int, ...] = ()  # positions whose token was forced, not sampled

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @staticmethod
    def concat(blocks: list[Block]) -> Block:
        """Consecutive blocks (a stream's chunks) as one; the tail where every block has one."""

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(b, name) for b in blocks])

        tail = joined("tail") if all(b.tail is not None for b in blocks) else None
        starts = np.cumsum([0, *(len(b) for b in blocks)])
        forced = tuple(int(s + i) for s, b in zip(starts, blocks) for i in b.forced)
        return Block(
            joined("token_ids"),
            joined("logprobs"),
            joined("ranks"),
            joined("top_ids"),
            joined("top_logprobs"),
            tail,
            forced,
        )


def decode_block(obj: dict[str, Any]) -> Block:
    """A block of either encoding (a dict as `json.loads` or the openai client returns it) as
    numpy arrays."""
    if "n" in obj:  # base64
        n, k = int(obj["n"]), int(obj["k"])

        def col(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            raw = base64.b64decode(obj[name])
            return np.frombuffer(raw, dtype).astype(dtype[1:]).reshape(shape)

        return Block(
            col("token_ids", "<i4", (n,)),
            col("logprobs", "<f4", (n,)),
            col("ranks", "<i4", (n,)),
            col("top_ids", "<i4", (n, k)),
            col("top_logprobs", "<f4", (n, k)),
            col("tail_logprobs", "<f4", (n,)) if "tail_logprobs" in obj else None,
            tuple(obj.get("forced", ())),
        )
    n = len(obj["token_ids"])
    k = len(obj["top_ids"][0]) if n else 0
    tail = obj.get("tail_logprobs")
    return Block(
        np.asarray(obj["token_ids"], np.int32),
        np.asarray(obj["logprobs"], np.float64).astype(np.float32),
        np.asarray(obj["ranks"], np.int32),
        np.asarray(obj["top_ids"], np.int32).reshape(n, k),
        np.asarray(obj["top_logprobs"], np.float64).astype(np.float32).reshape(n, k),
        None if tail is None else np.asarray(tail, np.float64).astype(np.float32),
        tuple(obj.get("forced", ())),
    )
