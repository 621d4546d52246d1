"""The scripted reasoning model the tests serve, and the closed form of its logprobs.

Each case is a script (chosen by the last word of the user's message) whose segments are marked
reasoning ("r") or content ("c"): the tokens of an "r" segment must come back in
`logprobs.reasoning_content`, the others in `logprobs.content`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.models.scripted import ALT_STRIDE, FORMAT, script_ids
from omlx_logprobs.vocab import Vocabulary

CHOSEN_LOGIT = 9.0
CHOSEN_SLOPE = 0.0625  # so that every step's distribution differs
OTHER_LOGITS = [7.5 - 0.25 * j for j in range(24)]  # 24 distinct: top 20 is fully determined
# Low, so that the float32 sum over the vocabulary is exact to ~1e-7: MLX's CPU logsumexp adds
# 49k equal small terms one by one and drifts by ~5e-4 nats when they are at logit 0.
REST_LOGIT = -16.0
THINK = {"tokens": ["<think>"]}
END = {"tokens": ["</think>"]}


@dataclass(frozen=True)
class Case:
    segments: list[tuple[str, dict[str, Any]]]  # ("r" | "c", segment)
    reasoning: str  # expected message.reasoning_content ("" for null)
    content: str
    stop_token_in_reasoning: bool = False  # where <|im_end|> falls (unclosed reasoning: there)


CASES: dict[str, Case] = {
    "special": Case(
        [
            ("r", THINK),
            ("r", {"text": "Let me see: x < y, <div> and a<b."}),
            ("r", END),
            ("c", {"text": "\n\nSo a<b, x < y and <div>."}),
        ],
        "Let me see: x < y, <div> and a<b.",
        "\n\nSo a<b, x < y and <div>.",
    ),
    "spelled": Case(
        [
            ("r", {"tokens": ["<", "think", ">"]}),
            ("r", {"text": "Two and two"}),
            ("r", {"tokens": ["</", "think", ">"]}),
            ("c", {"text": "Four."}),
        ],
        "Two and two",
        "Four.",
    ),
    "chars": Case(
        [
            ("r", {"bytes": "<think>"}),
            ("r", {"text": "hm"}),
            ("r", {"bytes": "</think>"}),
            ("c", {"text": "ok"}),
        ],
        "hm",
        "ok",
    ),
    "split": Case(
        [
            ("r", {"text": "<th"}),
            ("r", {"text": "ink>deep"}),
            ("r", {"text": "</th"}),
            ("r", {"text": "ink>"}),
            ("c", {"text": "Yes <th"}),
            ("c", {"text": "ink> is text here"}),
        ],
        "deep",
        "Yes <think> is text here",
    ),
    "joined": Case(
        [
            ("r", THINK),
            ("r", {"text": "short"}),
            ("r", {"tokens": ["</think>\n\nThe"]}),
            ("c", {"text": " end."}),
        ],
        "short",
        "\n\nThe end.",
    ),
    "open": Case(
        [("r", THINK), ("r", {"text": "never closed, x < y"})],
        "never closed, x < y",
        "",
        stop_token_in_reasoning=True,
    ),
    "only": Case([("r", THINK), ("r", {"text": "just thinking"}), ("r", END)], "just thinking", ""),
    "bytes": Case(
        [
            ("r", THINK),
            ("r", {"bytes": "😀日本"}),
            ("r", END),
            ("c", {"bytes": "日😀"}),
            ("c", {"text": " 東京"}),
        ],
        "😀日本",
        "日😀 東京",
    ),
    "plain": Case([("c", {"text": "<div>x < y</div> a<b"})], "", "<div>x < y</div> a<b"),
    "opened": Case(
        [
            ("r", {"tokens": ["<think>", "\n"]}),  # what the template writes when it opens
            ("r", {"text": "inside"}),
            ("r", END),
            ("c", {"text": " out"}),
        ],
        "\ninside",
        " out",
    ),
}


def case_ids(model: LoadedModel, name: str) -> tuple[list[int], int]:
    """(the case's script ids then the stop token, how many of them are reasoning)."""
    case = CASES[name]
    ids, n_reasoning = [], 0
    for section, seg in case.segments:
        more = script_ids([seg], model.tokenizer)
        ids += more
        n_reasoning += len(more) if section == "r" else 0
    eos = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return ids + [eos], n_reasoning + int(case.stop_token_in_reasoning)


def write_description(path: Path, **overrides: Any) -> Path:
    desc = {
        "format": FORMAT,
        "name": "scripted-thinker",
        "think_tokens": "special",
        "added_tokens": ["</think>\n\nThe"],
        "chosen_logit": CHOSEN_LOGIT,
        "chosen_slope": CHOSEN_SLOPE,
        "other_logits": OTHER_LOGITS,
        "rest_logit": REST_LOGIT,
        "scripts": {name: [seg for _, seg in case.segments] for name, case in CASES.items()},
        **overrides,
    }
    path.write_text(json.dumps(desc, ensure_ascii=False))
    return path


@dataclass(frozen=True)
class Expected:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # all alternatives and the token, best first


def expected(step: int, token: int, vocab_size: int) -> Expected:
    """The closed form, in float64: logit - log(sum of exp(logits)) over the whole vocabulary."""
    chosen = CHOSEN_LOGIT + CHOSEN_SLOPE * step
    alts = [((token + 1 + ALT_STRIDE * j) % vocab_size, v) for j, v in enumerate(OTHER_LOGITS)]
    rest = (vocab_size - 1 - len(alts)) * math.exp(REST_LOGIT)
    lse = math.log(math.exp(chosen) + sum(math.exp(v) for _, v in alts) + rest)
    top = sorted([(token, chosen), *alts], key=lambda p: -p[1])
    return Expected(token, chosen - lse, [(t, v - lse) for t, v in top])


def check_entries(
    entries: list[Any], ids: list[int], first_step: int, vocab: Vocabulary, k: int
) -> None:
    """Entries (openai objects or dicts) against the closed form, step by step."""
    assert len(entries) == len(ids)
    n = len(vocab)

    def shown(tid: int) -> tuple[str, list[int] | None]:
        b = vocab.token_bytes[tid]
        return vocab.token_text[tid], None if b is None else list(b)

    for i, (e, tid) in enumerate(zip(entries, ids)):
        want = expected(first_step + i, tid, n)
        e = e if isinstance(e, dict) else e.model_dump()
        assert (e["token"], e["bytes"]) == shown(tid)
        assert abs(e["logprob"] - want.logprob) < 2e-5
        tops = e["top_logprobs"]
        assert [(t["token"], t["bytes"]) for t in tops] == [shown(t) for t, _ in want.top[:k]]
        np.testing.assert_allclose(
            [t["logprob"] for t in tops], [v for _, v in want.top[:k]], atol=2e-5
        )
