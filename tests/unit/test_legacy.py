"""The legacy Completions logprobs shape from entry blocks: string keys that collide keep the
higher-ranked value, the position's own token is always present, offsets count characters."""

from __future__ import annotations

import json

import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.options import build_parser
from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary, token_display

PIECES: list[bytes | None] = [None, b"true", b" true", b"true", "é".encode(), b"\xe6\x97", b"\xa5"]
VOCAB = Vocabulary(
    tuple(PIECES), tuple(token_display(b, "<|end|>") for b in PIECES)
)  # id 3 decodes like id 1; ids 5 and 6 split one character


def store_of(rows: list[tuple[int, float, list[int], list[float]]], k: int) -> Entries:
    s = LogprobStore(k)
    for tok, lp, ids, lps in rows:
        ids_b = np.array(ids, np.int32)[:k].tobytes()
        s.append(tok, lp, 1, ids_b, np.array(lps, np.float32)[:k].tobytes())
    return s.block(0, len(s))


def test_colliding_strings_keep_the_higher_ranked_and_own_token_is_present() -> None:
    fmt = LegacyLogprobFormatter(VOCAB)
    store = store_of([(3, -2.0, [1, 2], [-0.5, -1.0]), (4, -3.0, [1, 3], [-0.125, -0.25])], 2)
    out = json.loads(fmt.json(LegacyCursor(), 2, None, store))
    assert out["tokens"] == ["true", "é"]
    # id 3 ("true", -2.0) collides with the higher-ranked id 1 ("true", -0.5): -0.5 stays
    assert out["top_logprobs"][0] == {"true": -0.5, " true": -1.0}
    assert out["top_logprobs"][1] == {"true": -0.125, "é": -3.0}  # own token added last
    assert out["token_logprobs"] == [-2.0, -3.0]


def test_echo_offsets_count_characters_and_split_characters_once() -> None:
    fmt = LegacyLogprobFormatter(VOCAB)
    prompt_ids = [0, 4, 5, 6, 2]
    pstore = store_of([(t, -1.0, [], []) for t in prompt_ids[1:]], 0)
    text = fmt.prompt_text(prompt_ids)
    assert text == "<|end|>é日 true"
    cursor = LegacyCursor()
    out = json.loads(fmt.json(cursor, 0, (prompt_ids, pstore), Entries.empty(0)))
    assert out["text_offset"] == [0, 7, 8, 9, 9]  # the split 日 counts at its first byte
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert out["top_logprobs"][1] == {"é": -1.0} and cursor.offset == len(text)
    assert out["tokens"][2] == "bytes:\\xe6\\x97"


def test_tokens_as_ids() -> None:
    fmt = LegacyLogprobFormatter(VOCAB, as_ids=True)
    out = json.loads(fmt.json(LegacyCursor(), 1, None, store_of([(1, -1.0, [3], [-0.5])], 1)))
    assert out["tokens"] == ["token_id:1"]
    assert out["top_logprobs"] == [{"token_id:3": -0.5, "token_id:1": -1.0}]


def test_server_default_logprobs_mode_flag() -> None:
    args = build_parser().parse_args(["serve", "--logprobs-mode", "processed_logprobs"])
    assert args.logprobs_mode == "processed_logprobs"
    assert EngineConfig(logprobs_mode=args.logprobs_mode).logprobs_mode == "processed_logprobs"
    assert build_parser().parse_args(["serve"]).logprobs_mode == "raw_logprobs"
