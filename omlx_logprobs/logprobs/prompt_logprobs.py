"""Prompt logprobs in vLLM's shape: one entry per prompt position, `null` for the first, else
`{"<token id>": {"logprob", "rank", "decoded_token"}}` holding the prompt token and its top list
(or its `logprob_token_ids`)."""

from __future__ import annotations

import json

from omlx_logprobs.logprobs.format import Pieces, float_numbers, token_string
from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary


class PromptLogprobFormatter:
    def __init__(self, vocab: Vocabulary, as_ids: bool = False) -> None:
        self.vocab = vocab
        self.as_ids = as_ids
        # Per id, the text around an entry's logprob and rank: made once, then looked up.
        self._head: Pieces[str] = Pieces(lambda tid: f'"{tid}":{{"logprob":')
        self._tail: Pieces[str] = Pieces(self._decoded)

    def _decoded(self, tid: int) -> str:
        text = json.dumps(token_string(self.vocab, tid, self.as_ids), ensure_ascii=False)
        return f',"decoded_token":{text}}}'

    def json(self, e: Entries, k: int, fixed: bool, blank: frozenset[int] = frozenset()) -> str:
        """The list for every prompt position: the prompt token and `k` top entries (rank = place
        in the list). With `fixed` ids, all of them, rank null: only the prompt token's rank is
        computed. Positions in `blank` (an image's placeholder tokens: not text) are null."""
        if fixed:
            k = e.k
        s = e.k
        head, tail = self._head, self._tail
        tids, ranks = e.token_ids.tolist(), e.ranks.tolist()
        lps = float_numbers(e.logprobs)
        top_ids = e.top_ids.ravel().tolist() if k else []
        top_lps = float_numbers(e.top_logprobs.ravel()) if k else []
        top_ranks = [',"rank":null' if fixed else f',"rank":{j + 1}' for j in range(k)]
        parts = ["null"]
        for i, tid in enumerate(tids):
            if i + 1 in blank:
                parts.append("null")
                continue
            items = [head[tid] + lps[i] + ',"rank":' + str(ranks[i]) + tail[tid]]
            for j in range(k):
                t = top_ids[i * s + j]
                if t != tid:
                    items.append(head[t] + top_lps[i * s + j] + top_ranks[j] + tail[t])
            parts.append("{" + ",".join(items) + "}")
        return "[" + ",".join(parts) + "]"
