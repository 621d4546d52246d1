"""The engine's side of constrained decoding: one llguidance matcher per constrained row,
advanced by the output processor with each sampled token, and the batch's allowed-token bitmask
that the model runner turns into the rows' token masks for the next step (runner/sampler.py).
Plain Python and numpy: llguidance computes a row's mask from its state in a few microseconds
(bench/experiments/grammar_engines.py)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as lln
import numpy as np

from omlx_logprobs.parsing.grammar import GrammarError, check
from omlx_logprobs.types import Constraint, ConstraintKind

__all__ = ["Grammars", "GrammarError", "bitmask", "leaves", "open_ended"]

# From this many constrained rows, llguidance's thread pool fills the masks (a single row's
# call is cheaper than handing it to the pool).
PARALLEL_ROWS = 8


class Grammars:
    """Matchers for one served model. llguidance's tokenizer (every token's bytes, in about a
    second) is built at the first constrained request, not at start."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos)
        self._tok: Any = None

    def matcher(self, c: Constraint) -> Any:
        """A fresh matcher at the grammar's start; GrammarError if it cannot be built."""
        if self._hf is None:
            raise GrammarError("constrained decoding needs the model's tokenizer")
        if self._tok is None:
            self._tok = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self._vocab_size, eos_token=self._eos or None
            )
        m = llguidance.LLMatcher(self._tok, check(c), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m


@lru_cache(maxsize=1)
def _executor() -> Any:
    return llguidance.LLExecutor()


def open_ended(c: Constraint | None) -> bool:
    """Tool calls: once complete, the model samples freely, and a token that does not continue
    them ends the output (a model that wants to end its turn after a call, or to write text
    after it, is not made to call again)."""
    return c is not None and c.kind is ConstraintKind.TOOL_CALLS


def leaves(matcher: Any, c: Constraint | None, token: int) -> bool:
    """Whether `token` ends an open-ended row's output: its grammar is complete and does not
    admit the token (checked before the matcher consumes it)."""
    return open_ended(c) and matcher.is_accepting() and not matcher.validate_tokens([token])


def bitmask(
    matchers: list[Any], vocab_size: int, open_rows: Sequence[bool] = ()
) -> np.ndarray | None:
    """[B, ceil(V/32)] int32, bit t of row i set where row i may sample token t next; None when
    no row has a grammar. A complete grammar allows only EOS, unless its row is in `open_rows`
    (`open_ended`), which then allows every token. Rows without one, and rows whose matcher
    allows nothing or is in error (finished rows waiting to leave the batch), allow every
    token."""
    rows = [
        (m, i)
        for i, m in enumerate(matchers)
        if m is not None
        and not m.is_error()
        and not (open_rows and open_rows[i] and m.is_accepting())
    ]
    if not rows:
        return None
    bits = lln.allocate_token_bitmask(len(matchers), vocab_size)
    if len(rows) >= PARALLEL_ROWS:
        lln.fill_next_token_bitmask_par(_executor(), rows, bits)
    else:
        for m, i in rows:
            lln.fill_next_token_bitmask(m, bits, i)
    bits[~bits.any(axis=1)] = -1  # a finished row's matcher allows nothing: keep it finite
    return bits
