"""Prompt logprobs in vLLM's shape: one entry per prompt position, `null` for the first, else
`{"<token id>": {"logprob", "rank", "decoded_token"}}` holding the prompt token and its top list
(or its `logprob_token_ids`)."""

from __future__ import annotations

import json

from omlx_logprobs.logprobs.format import num, token_string
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.output.detokenizer import Vocabulary


class PromptLogprobFormatter:
    def __init__(self, vocab: Vocabulary, as_ids: bool = False) -> None:
        self.vocab = vocab
        self.as_ids = as_ids

    def _entry(self, tid: int, logprob: float, rank: int | None) -> str:
        text = json.dumps(token_string(self.vocab, tid, self.as_ids), ensure_ascii=False)
        r = "null" if rank is None else str(rank)
        return f'"{tid}":{{"logprob":{num(logprob)},"rank":{r},"decoded_token":{text}}}'

    def json(self, store: LogprobStore, k: int, fixed: bool) -> str:
        """The list for every prompt position: the prompt token and `k` top entries (rank = place
        in the list). With `fixed` ids, all of them, rank null: only the prompt token's rank is
        computed."""
        if fixed:
            k = store.k
        parts = ["null"]
        for i in range(len(store)):
            tid = store.token_ids[i]
            items = [self._entry(tid, store.logprobs[i], store.ranks[i])]
            if k:
                ids, lps = store.top(i)
                for j, (t, v) in enumerate(zip(ids[:k], lps[:k])):
                    if t != tid:
                        items.append(self._entry(t, v, None if fixed else j + 1))
            parts.append("{" + ",".join(items) + "}")
        return "[" + ",".join(parts) + "]"
