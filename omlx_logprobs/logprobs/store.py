"""One request's entries while the engine produces them: parallel typed arrays that grow by a
position a step (a constant number of Python objects however many tokens a request generates),
read out as `Entries` blocks when tokens are released."""

from __future__ import annotations

from array import array

import numpy as np

from omlx_logprobs.logprobs.tail import narrowed
from omlx_logprobs.types import Entries


class LogprobStore:
    """Entries for every generated (or every scored prompt) token, in order: the token's id, its
    logprob and rank, and the request's own k alternatives per position (its top k, best first,
    or the logprobs of its `logprob_token_ids`, in the order asked); with `tail`, each position's
    tail mass (logprobs/tail.py), the column filled last. `forced`: the positions whose token
    the server forced (a thinking budget's closing tag), few or none."""

    __slots__ = ("k", "token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "tail", "forced")

    def __init__(self, k: int, tail: bool = False) -> None:
        self.k = k
        self.token_ids = array("i")
        self.logprobs = array("f")
        self.ranks = array("i")
        self.top_ids = array("i")
        self.top_logprobs = array("f")
        self.tail = array("f") if tail else None
        self.forced: list[int] = []

    def __len__(self) -> int:
        return len(self.logprobs)

    def append(
        self,
        token: int,
        logprob: float,
        rank: int,
        top_ids: bytes,
        top_lps: bytes,
        tail: float | None = None,
    ) -> None:
        """One position; the top list as raw int32 ids and float32 logprobs, best first."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        if self.k:
            self.top_ids.frombytes(top_ids)
            self.top_logprobs.frombytes(top_lps)
        if self.tail is not None:
            self.tail.append(float("nan") if tail is None else tail)

    def extend(self, rows: Entries) -> None:
        """Append host entries (a prompt chunk); their top lists may be wider than k (the tail
        then widens to count what is left out)."""
        if self.tail is not None:
            rows = narrowed(rows, self.k)
        self.token_ids.frombytes(rows.token_ids.astype(np.int32).tobytes())
        self.logprobs.frombytes(rows.logprobs.astype(np.float32).tobytes())
        self.ranks.frombytes(rows.ranks.astype(np.int32).tobytes())
        if self.k:
            k = self.k
            self.top_ids.frombytes(np.ascontiguousarray(rows.top_ids[:, :k], np.int32).tobytes())
            self.top_logprobs.frombytes(
                np.ascontiguousarray(rows.top_logprobs[:, :k], np.float32).tobytes()
            )
        if self.tail is not None:
            self.tail.frombytes(np.asarray(rows.tail, np.float32).tobytes())

    def block(self, start: int, end: int) -> Entries:
        """Positions [start, end) as numpy copies (never views: the arrays keep growing)."""
        k, n = self.k, end - start
        return Entries(
            np.frombuffer(self.token_ids[start:end], np.int32),
            np.frombuffer(self.logprobs[start:end], np.float32),
            np.frombuffer(self.ranks[start:end], np.int32),
            np.frombuffer(self.top_ids[start * k : end * k], np.int32).reshape(n, k),
            np.frombuffer(self.top_logprobs[start * k : end * k], np.float32).reshape(n, k),
            None if self.tail is None else np.frombuffer(self.tail[start:end], np.float32),
            self._forced(start, end),
        )

    def mark_forced(self) -> None:
        """The last position's token was forced, not sampled."""
        self.forced.append(len(self) - 1)

    def _forced(self, start: int, end: int) -> np.ndarray | None:
        inside = [i - start for i in self.forced if start <= i < end]
        if not inside:
            return None
        marks = np.zeros(end - start, bool)
        marks[inside] = True
        return marks
