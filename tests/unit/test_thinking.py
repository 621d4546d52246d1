"""The thinking parser through the real output processor: every split of the output into tokens
gives the same reasoning and content, each entry exactly once, in the section where its first
byte falls, released with the chunk that carries its last byte."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from transformers import AddedToken, AutoTokenizer

from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.engine.processor import OutputProcessor
from omlx_logprobs.parsing.thinking import (
    ReasoningParser,
    ThinkStart,
    has_think_markers,
    parser_enabled,
    think_start,
)
from omlx_logprobs.runner.step import StepResult
from omlx_logprobs.types import FinishReason, RequestOutput, SamplingParams
from omlx_logprobs.vocab import Vocabulary, build_vocabulary, token_display

DETECT, INSIDE, OFF = ThinkStart.DETECT, ThinkStart.INSIDE, ThinkStart.OFF


def run(
    pieces: list[bytes | None], start: ThinkStart, stops: tuple[str, ...] = ()
) -> tuple[Sequence, list[RequestOutput]]:
    """One token per piece, one step per token; a None piece is a stop token (no bytes)."""
    vocab = Vocabulary(tuple(pieces), tuple(token_display(p, "<|im_end|>") for p in pieces))
    eos = tuple(i for i, p in enumerate(pieces) if p is None)
    outs: list[RequestOutput] = []
    proc = OutputProcessor(vocab, eos)
    seq = Sequence("r", [0], SamplingParams(max_tokens=max(len(pieces), 1), stop=stops), start)
    for i in range(len(pieces)):
        if seq.status is Status.FINISHED:
            break
        proc.process(StepResult([seq], np.array([i]), np.array([True]), None))
        outs += proc.take()
    return seq, outs


def spans(outs: list[RequestOutput]) -> list[tuple[int, int, int]]:
    """Each output's tokens as positions of the whole output: (first, first content, end)."""
    out, first = [], 0
    for o in outs:
        out.append((first, first + o.num_reasoning, first + o.num_tokens))
        first += o.num_tokens
    return out


def layout(raw: bytes, start: ThinkStart) -> tuple[int | None, int, int]:
    """Independently: (reasoning text start or None, its end, content start; len+1: none)."""
    if start is OFF:
        return None, 0, 0
    r0 = 0 if start is INSIDE else (7 if raw.startswith(b"<think>") else None)
    if r0 is None:
        return None, 0, 0
    close = raw.find(b"</think>", r0)
    return (r0, close, close + 8) if close >= 0 else (r0, len(raw), len(raw) + 1)


def check(pieces: list[bytes | None], start: ThinkStart) -> list[RequestOutput]:
    seq, outs = run(pieces, start)
    raw = b"".join(p or b"" for p in pieces)
    r0, r1, c0 = layout(raw, start)
    reasoning = raw[r0:r1] if r0 is not None else b""
    content = raw[c0:]
    assert outs[-1].finished and len(outs[-1:]) == 1
    assert "".join(o.reasoning_text for o in outs) == reasoning.decode(errors="replace")
    assert "".join(o.text for o in outs) == content.decode(errors="replace")
    # Every entry once, in order, reasoning before content.
    assert sum(o.num_tokens for o in outs) == len(pieces)
    starts = [0] + list(np.cumsum([len(p or b"") for p in pieces]))[:-1]
    want_reasoning = [i for i, s in enumerate(starts) if s < c0]
    got_reasoning = [i for f, r, _ in spans(outs) for i in range(f, r)]
    got_content = [i for _, r, e in spans(outs) for i in range(r, e)]
    assert got_reasoning == want_reasoning
    assert got_reasoning + got_content == list(range(len(pieces)))
    merged = functools.reduce(RequestOutput.merge, outs)
    assert merged.num_reasoning == len(want_reasoning)
    assert (merged.reasoning_text, merged.text) == (
        reasoning.decode(errors="replace"),
        content.decode(errors="replace"),
    )
    for (a, b), (sa, sb) in zip(zip(outs, outs[1:]), zip(spans(outs), spans(outs)[1:])):
        m = a.merge(b)
        assert list(range(sa[0], sa[0] + m.num_reasoning)) == [
            i for f, r, _ in (sa, sb) for i in range(f, r)
        ]
    if _valid(reasoning) and _valid(content):
        assert "\ufffd" not in "".join(o.reasoning_text + o.text for o in outs)
        _check_alignment(pieces, outs, r0, c0, len(reasoning))
    return outs


def _valid(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def _check_alignment(
    pieces: list[bytes | None], outs: list[RequestOutput], r0: int | None, c0: int, r_len: int
) -> None:
    """A token whose last byte is text goes out in the chunk that releases that byte."""
    released_in = {i: k for k, (f, _, e) in enumerate(spans(outs)) for i in range(f, e)}
    r_cum = np.cumsum([len(o.reasoning_text.encode()) for o in outs])
    c_cum = np.cumsum([len(o.text.encode()) for o in outs])
    end = 0
    for i, p in enumerate(pieces):
        end += len(p or b"")
        if not p:
            continue
        last = end - 1
        if r0 is not None and r0 <= last < r0 + r_len:
            k = int(np.searchsorted(r_cum, last - r0, side="right"))
        elif last >= c0:
            k = int(np.searchsorted(c_cum, last - c0, side="right"))
        else:
            continue  # a tag byte: no text carries it
        assert released_in[i] == k, (pieces, i)


def splits(data: bytes, cuts: int) -> list[list[bytes]]:
    """Every way of cutting data into `cuts + 1` pieces (empty pieces allowed)."""
    n = len(data)
    if cuts == 1:
        return [[data[:a], data[a:]] for a in range(n + 1)]
    return [[data[:a], data[a:b], data[b:]] for a in range(n + 1) for b in range(a, n + 1)]


TEXTS = [
    "<think>ab</think>cd",
    "<think>x < y <div> a<b</think>a<b x < y <div>",
    "<think>é😀日</think>日本😀",
    "<think>unclosed <th",
    "<think>only reasoning</think>",
    "<think><think>nested</think></think>",
    "<thin",
    "</think>not a tag here",
    "<div>hello</think>",
    "a<b",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("start", [DETECT, INSIDE, OFF])
def test_every_split_into_three_tokens_then_the_stop_token(text: str, start: ThinkStart) -> None:
    for parts in splits(text.encode(), 2):
        check([*parts, None], start)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_one_byte_per_token_and_no_stop_token(text: str) -> None:
    data = text.encode()
    check([data[i : i + 1] for i in range(len(data))], DETECT)


def test_tags_as_single_tokens_and_a_token_straddling_the_end_tag() -> None:
    pieces = [b"<think>", b"ok", b"</think>\n\nThe", b" end", None]
    outs = check(pieces, DETECT)
    straddle_at, straddle = next((sp, o) for sp, o in zip(spans(outs), outs) if sp[0] <= 2 < sp[2])
    assert straddle_at[1] > 2  # a reasoning entry ...
    assert straddle.text == "\n\nThe"  # ... released with the answer text it carries
    check([b"<think>ok</think>Hi", None], DETECT)
    check([b"<th", b"ink>ok</", b"think", b">Hi"], DETECT)


def test_the_stop_token_falls_where_the_output_stands() -> None:
    after_close = check([b"<think>", b"r", b"</think>", None], DETECT)
    assert spans(after_close)[-1][1] == 3  # the stop token is content (empty answer)
    unclosed = check([b"<think>", b"r", None], DETECT)
    assert spans(unclosed)[-1][1] == 3 and unclosed[-1].finish_reason is FinishReason.STOP
    assert spans(check([None], DETECT))[-1][1] == 0


def test_a_lone_lt_in_reasoning_is_released_with_its_token_once_settled() -> None:
    seq, outs = run([b"<think>", b"x <", b" y", b"</think>", b"a<b", None], DETECT)
    texts = [(o.reasoning_text, o.text, f, e) for o, (f, _, e) in zip(outs, spans(outs))]
    # "x <" holds "<" (maybe "</think>"), so the whole token, "x " included, waits for " y"
    # which settles it: text leaves only at token boundaries.
    assert texts[:3] == [("", "", 0, 1), ("x < y", "", 1, 3), ("", "", 3, 4)]
    assert ("", "a<b", 4, 5) in texts  # no hold-back in content: released at once


def test_stop_strings_apply_to_content_only() -> None:
    pieces = [b"<think>", b"a STOP b", b"</think>", b"c ST", b"OP d", None]
    seq, outs = run(pieces, DETECT, stops=("STOP",))
    assert "".join(o.reasoning_text for o in outs) == "a STOP b"
    assert "".join(o.text for o in outs) == "c "
    assert seq.finish_reason is FinishReason.STOP and spans(outs)[-1][2] == 5
    assert spans(outs)[-1][1] == 3


def test_start_from_the_prompt_and_the_mode() -> None:
    assert think_start(False, "<think>\n") is OFF
    assert think_start(True, "<|im_start|>assistant\n<think>\n") is INSIDE
    assert think_start(True, "<think>\n\n</think>\n\n") is DETECT
    assert think_start(True, "assistant\n") is DETECT


def test_markers_in_the_vocabulary_or_the_template(embedded_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(embedded_dir))
    assert not has_think_markers(tok)
    assert not parser_enabled(ReasoningParser.AUTO, tok)
    assert parser_enabled(ReasoningParser.THINK, tok)
    tok.chat_template = "{{ '<think>\\n' }}"
    assert has_think_markers(tok)
    tok = AutoTokenizer.from_pretrained(str(embedded_dir))
    tok.add_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>")])
    assert parser_enabled(ReasoningParser.AUTO, tok)
    assert not parser_enabled(ReasoningParser.NONE, tok)
    vocab = build_vocabulary(tok, len(tok))
    tid = tok.convert_tokens_to_ids("<think>")
    assert vocab.token_bytes[tid] == b"<think>" and vocab.token_text[tid] == "<think>"
    assert vocab.token_bytes[tok.convert_tokens_to_ids("<|im_end|>")] is None
