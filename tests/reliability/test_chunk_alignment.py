"""Chunk-by-chunk alignment: every delta the output processor releases carries exactly the
entries of its own tokens, and its text is exactly what those tokens' bytes make. So at every
delta, the text released so far is the answer the tokens released so far would give on their own
(the thinking parser's sections, tags removed, content cut at a stop string), computed here
independently from the raw bytes."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.engine.processor import OutputProcessor
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.parsing.thinking import ThinkStart
from omlx_logprobs.runner.step import StepResult
from omlx_logprobs.types import RequestOutput, SamplingParams

OPEN, CLOSE = b"<think>", b"</think>"


@dataclass
class Run:
    """One request fed token by token; `released[t]` is how many tokens had gone out after
    token t was processed."""

    tokens: list[int]
    outs: list[RequestOutput] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    seq: Sequence | None = None


def run(
    tiny: LoadedModel, tokens: list[int], stop: tuple[str, ...] = (), think: bool = False
) -> Run:
    r = Run(tokens)
    proc = OutputProcessor(tiny.vocab, tiny.eos_token_ids)
    params = SamplingParams(max_tokens=len(tokens), stop=stop)
    r.seq = Sequence("r", [1, 2, 3], params, ThinkStart.DETECT if think else ThinkStart.OFF)
    for t in tokens:
        if r.seq.status.name == "FINISHED":
            break
        proc.process(StepResult([r.seq], np.array([t]), np.array([True]), None))
        r.outs += proc.take()
        r.released.append(sum(o.num_tokens for o in r.outs))
    return r


def answer_for(raw: bytes, think: bool, stop: tuple[str, ...]) -> tuple[str, str, int | None]:
    """The answer these output bytes give at once: reasoning, content, content's raw start."""
    reasoning, content, content_from = b"", raw, 0
    if think and raw.startswith(OPEN):
        at = raw.find(CLOSE, len(OPEN))
        if at < 0:
            reasoning, content, content_from = raw[len(OPEN) :], b"", None
        else:
            content_from = at + len(CLOSE)
            reasoning, content = raw[len(OPEN) : at], raw[content_from:]
    text = content.decode("utf-8", "replace")
    hits = [text.find(s) for s in stop if s in text]
    return reasoning.decode("utf-8", "replace"), text[: min(hits)] if hits else text, content_from


def check_aligned(tiny: LoadedModel, r: Run, think: bool, stop: tuple[str, ...] = ()) -> None:
    assert r.seq is not None
    ids = list(r.seq.output_ids)
    pieces = [tiny.vocab.token_bytes[t] or b"" for t in ids]
    reasoning = content = ""
    position = 0
    for o in r.outs:  # each output's tokens follow the last one's: each entry once, in order
        first, position = position, position + o.num_tokens
        assert o.logprobs is None or len(o.logprobs) == o.num_tokens
        reasoning += o.reasoning_text
        content += o.text
        raw = b"".join(pieces[:position])
        want_r, want_c, content_from = answer_for(raw, think, stop)
        assert (reasoning, content) == (want_r, want_c), (raw, o)
        # A token is reasoning when its first byte falls before the content (tags included).
        starts = np.cumsum([0] + [len(p) for p in pieces[:position]])[:-1]
        for i in range(first, position):
            if pieces[i]:
                is_reasoning = content_from is None or starts[i] < content_from
                assert (i < first + o.num_reasoning) == is_reasoning, (i, o)
    assert r.outs[-1].finished and position == len(ids)


def vocab_ids(tiny: LoadedModel) -> dict[bytes, int]:
    return {b: i for i, b in enumerate(tiny.vocab.token_bytes) if b}


def random_split(data: bytes, ids: dict[bytes, int], rng: random.Random) -> list[int]:
    """The bytes as a sequence of real vocabulary tokens, cut at random places (every single
    byte is a token of the byte-level vocabulary, so every cut is possible)."""
    out, i = [], 0
    while i < len(data):
        lengths = [n for n in range(1, 9) if data[i : i + n] in ids]
        n = rng.choice(lengths)
        out.append(ids[data[i : i + n]])
        i += n
    return out


def test_a_token_ending_inside_a_character_goes_out_with_the_rest(tiny: LoadedModel) -> None:
    tokens = [34, 21004, 226, 216, 34]  # "2", " \xe2\x89", "\x88", " ", "2": "2 ≈ 2"
    assert tiny.vocab.token_bytes[21004] == b" \xe2\x89"
    r = run(tiny, tokens)
    check_aligned(tiny, r, think=False)
    # Nothing waits longer than its own bytes: " \xe2\x89" goes out with "\x88", the rest at once.
    assert r.released == [1, 1, 3, 4, 5]
    assert [o.text for o in r.outs] == ["2", " ≈", " ", "2"]


def test_a_stop_string_held_mid_token_waits_whole_token(tiny: LoadedModel) -> None:
    ids = vocab_ids(tiny)
    tokens = [ids[b" hello"], ids[b" world"], ids[b"!"]]
    # "lo w..." may begin the stop string: " hello" waits whole, not " hel" first.
    r = run(tiny, tokens, stop=("lo there",))
    check_aligned(tiny, r, think=False, stop=("lo there",))
    assert r.released == [0, 2, 3] and [o.text for o in r.outs] == [" hello world", "!"]
    # It is one: the text stops before it, the tokens that completed it keep their entries.
    r = run(tiny, tokens, stop=("lo wor",))
    check_aligned(tiny, r, think=False, stop=("lo wor",))
    assert [(o.text, o.num_tokens, o.finished) for o in r.outs] == [(" hel", 2, True)]


@pytest.mark.parametrize("think", [False, True])
def test_every_split_of_a_text_releases_aligned_chunks(tiny: LoadedModel, think: bool) -> None:
    ids = vocab_ids(tiny)
    rng = random.Random(7)
    texts = [
        "<think>x < y, 日本 ≈ </th</think>\n\nThe 😀 answer</think> STOP here",
        "<think>é</think>é STO STOP",
        "<thin>k no tag ≈ 2 ST",
        "plain 東京 text 🎉🎉 with é",
    ]
    for text in texts:
        data = text.encode()
        for _ in range(40):
            for stop in [(), ("STOP",), ("≈ 2", "ST")]:
                r = run(tiny, random_split(data, ids, rng), stop=stop, think=think)
                check_aligned(tiny, r, think, stop)


def test_tags_inside_chunks(tiny: LoadedModel) -> None:
    """A tag spelt over tokens, a token straddling the end tag and the answer (`><`): each delta
    holds whole tokens, and its text the sections of their bytes."""
    ids = vocab_ids(tiny)
    pieces = [b"<", b"think", b">", b"a", b" <", b"/", b"think", b"><", b"b", b" <", b"think"]
    r = run(tiny, [ids[p] for p in pieces], think=True)
    check_aligned(tiny, r, think=True)
    # "<think>" settles at ">", "a" at once; " <" may begin "</think>": it waits whole and goes
    # with "><", a reasoning token whose "<" is the answer's first character.
    assert r.released == [0, 0, 3, 4, 4, 4, 4, 8, 9, 10, 11]
    firsts = np.cumsum([0] + [o.num_tokens for o in r.outs])[:-1]  # each output's first token
    splits = [int(f) + o.num_reasoning for f, o in zip(firsts, r.outs)]  # its first content one
    assert [(o.reasoning_text, o.text, s) for o, s in zip(r.outs, splits)] == [
        ("", "", 3),
        ("a", "", 4),
        (" ", "<", 8),
        ("", "b", 8),
        ("", " <", 9),
        ("", "think", 10),
    ]
