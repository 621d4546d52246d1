"""Flat per-request logprob storage: parallel typed arrays, a constant number of Python objects
however many tokens a request generates."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StoreRows:
    """Positions [start, end of the store) as raw native-order bytes: what crosses from the
    engine's process to the server's (engine/process.py)."""

    start: int
    token_ids: bytes
    logprobs: bytes
    ranks: bytes
    top_ids: bytes
    top_logprobs: bytes


def append_from(arr: array, start: int, data: bytes) -> None:
    """Append the items of `data`, which begin at index `start` of the sender's copy, that
    `arr` does not have yet (a resend of items already here adds nothing)."""
    have = len(arr) - start
    if have < 0:
        raise ValueError(f"items from {start} cannot follow {len(arr)}")
    arr.frombytes(data[have * arr.itemsize :])


class LogprobStore:
    """Entries for every generated (or every scored prompt) token, in order: the token's id, its
    logprob and rank, and the request's own k alternatives per position (its top k, best first,
    or the logprobs of its `logprob_token_ids`, in the order asked)."""

    __slots__ = ("k", "token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")

    def __init__(self, k: int) -> None:
        self.k = k
        self.token_ids = array("i")
        self.logprobs = array("f")
        self.ranks = array("i")
        self.top_ids = array("i")
        self.top_logprobs = array("f")

    def __len__(self) -> int:
        return len(self.logprobs)

    def append(self, token: int, logprob: float, rank: int, top_ids: bytes, top_lps: bytes) -> None:
        """One position; the top list as raw int32 ids and float32 logprobs, best first."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        if self.k:
            self.top_ids.frombytes(top_ids)
            self.top_logprobs.frombytes(top_lps)

    def extend(
        self,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        ranks: np.ndarray,
        top_ids: np.ndarray,
        top_lps: np.ndarray,
    ) -> None:
        """Append R positions at once (a prompt chunk): [R] arrays and [R, >=k] top lists."""
        self.token_ids.frombytes(tokens.astype(np.int32).tobytes())
        self.logprobs.frombytes(logprobs.astype(np.float32).tobytes())
        self.ranks.frombytes(ranks.astype(np.int32).tobytes())
        if self.k:
            self.top_ids.frombytes(np.ascontiguousarray(top_ids[:, : self.k], np.int32).tobytes())
            self.top_logprobs.frombytes(
                np.ascontiguousarray(top_lps[:, : self.k], np.float32).tobytes()
            )

    def rows(self, start: int) -> StoreRows:
        """Every position from `start` on, for another process's copy of this store."""
        a = start * self.k
        return StoreRows(
            start,
            self.token_ids[start:].tobytes(),
            self.logprobs[start:].tobytes(),
            self.ranks[start:].tobytes(),
            self.top_ids[a:].tobytes(),
            self.top_logprobs[a:].tobytes(),
        )

    def put(self, rows: StoreRows) -> None:
        """Append the positions of `rows` this copy lacks (positions it has are skipped)."""
        append_from(self.token_ids, rows.start, rows.token_ids)
        append_from(self.logprobs, rows.start, rows.logprobs)
        append_from(self.ranks, rows.start, rows.ranks)
        append_from(self.top_ids, rows.start * self.k, rows.top_ids)
        append_from(self.top_logprobs, rows.start * self.k, rows.top_logprobs)

    def top(self, i: int) -> tuple[array, array]:
        """The top list of position i: (ids, logprobs), best first."""
        a, b = i * self.k, (i + 1) * self.k
        return self.top_ids[a:b], self.top_logprobs[a:b]
