"""Logprob entries in OpenAI's chat shape, written straight to JSON text.

Entries are read from a request's flat store by position range; each token's `"token"` and
`"bytes"` fragment is serialised once per vocabulary id and reused.
"""

from __future__ import annotations

import json
import math
from array import array

import numpy as np

from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.output.detokenizer import Vocabulary

NEG_INF_LOGPROB = "-9999.0"  # OpenAI's own stand-in for a logprob of -inf


class NonFiniteLogprob(ValueError):
    """A NaN logprob must never reach a response."""


def num(x: float) -> str:
    """A logprob as JSON: -inf becomes -9999.0, NaN is refused."""
    if math.isfinite(x):
        return repr(x)
    if x == -math.inf:
        return NEG_INF_LOGPROB
    raise NonFiniteLogprob(f"non-finite logprob {x}")


def numbers(values: array) -> list[str]:
    """JSON numbers for a range of float32 logprobs, one `repr` each (-inf as -9999.0, NaN
    refused). `values` must be a copy (a slice): a numpy view of a store's own array would block
    the engine thread's appends to it ("cannot resize an array that is exporting buffers")."""
    floats = np.frombuffer(values, np.float32)
    if np.isfinite(floats).all():
        return list(map(float.__repr__, floats.tolist()))
    return [num(x) for x in floats.tolist()]


def token_string(vocab: Vocabulary, tid: int, as_ids: bool = False) -> str:
    """A token's `token` string: its vocabulary text, or vLLM's `token_id:<id>`."""
    if as_ids:
        return f"token_id:{tid}"
    return vocab.token_text[tid] if tid < len(vocab) else ""


class ChatLogprobFormatter:
    def __init__(self, vocab: Vocabulary, as_ids: bool = False) -> None:
        self.vocab = vocab
        self.as_ids = as_ids  # return_tokens_as_token_ids
        self._frags: dict[int, str] = {}
        self._heads: list[str | None] = [None] * len(vocab)  # '{"token":..,"bytes":..,"logprob":'

    def token_fragment(self, tid: int) -> str:
        """`"token": ..., "bytes": ...` for one id (bytes null for special tokens)."""
        frag = self._frags.get(tid)
        if frag is None:
            b = self.vocab.token_bytes[tid] if tid < len(self.vocab) else None
            text = token_string(self.vocab, tid, self.as_ids)
            raw = "null" if b is None else "[" + ",".join(map(str, b)) + "]"
            frag = f'"token":{json.dumps(text, ensure_ascii=False)},"bytes":{raw}'
            self._frags[tid] = frag
        return frag

    def _head_list(self, ids: array) -> list[str]:
        heads = self._heads
        if len(heads) <= max(ids, default=-1):
            heads.extend([None] * (max(ids) + 1 - len(heads)))
        for t in set(ids):
            if heads[t] is None:
                heads[t] = "{" + self.token_fragment(t) + ',"logprob":'
        return heads  # type: ignore[return-value]

    def entries(self, store: LogprobStore, start: int, end: int) -> str:
        """The JSON array of entries for positions [start, end).

        Built with list comprehensions over cached per-id heads and `repr` of each logprob: this
        runs on the event loop for every token and every alternative, so it must be cheap."""
        k = store.k
        ids, lps = store.token_ids[start:end], store.logprobs[start:end]
        top_ids, top_lps = (
            store.top_ids[start * k : end * k],
            store.top_logprobs[start * k : end * k],
        )
        heads = self._head_list(ids)
        if k:
            heads = self._head_list(top_ids)
            tops = [heads[t] + v + "}" for t, v in zip(top_ids, numbers(top_lps))]
            lists = [",".join(tops[i : i + k]) for i in range(0, len(tops), k)]
        else:
            lists = [""] * len(ids)
        body = [
            heads[t] + v + ',"top_logprobs":[' + top + "]}"
            for t, v, top in zip(ids, numbers(lps), lists)
        ]
        return "[" + ",".join(body) + "]"
