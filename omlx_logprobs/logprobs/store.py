"""Flat per-request logprob storage: parallel typed arrays, a constant number of Python objects
however many tokens a request generates."""

from __future__ import annotations

from array import array

import numpy as np


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

    def top(self, i: int) -> tuple[array, array]:
        """The top list of position i: (ids, logprobs), best first."""
        a, b = i * self.k, (i + 1) * self.k
        return self.top_ids[a:b], self.top_logprobs[a:b]
