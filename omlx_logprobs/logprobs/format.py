"""Logprob entries in OpenAI's chat shape, written straight to JSON text.

Entries are read from a request's flat store by position range; each token's `"token"` and
`"bytes"` fragment is serialised once per vocabulary id and reused.
"""

from __future__ import annotations

import json
import math

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

    def entries(self, store: LogprobStore, start: int, end: int) -> str:
        """The JSON array of entries for positions [start, end)."""
        parts = []
        frag = self.token_fragment
        k = store.k
        for i in range(start, end):
            top = ""
            if k:
                ids, lps = store.top(i)
                top = ",".join(
                    "{" + frag(t) + ',"logprob":' + num(v) + "}" for t, v in zip(ids, lps)
                )
            tid = store.token_ids[i]
            parts.append(
                "{"
                + frag(tid)
                + ',"logprob":'
                + num(store.logprobs[i])
                + ',"top_logprobs":['
                + top
                + "]}"
            )
        return "[" + ",".join(parts) + "]"
