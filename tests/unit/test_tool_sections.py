"""The tool-call section of a request's text (output/sections.py), no model: token by token as
the output processor drives it, calls leave whole with the token that ends them, content text
with the tokens that carry it, and the tool-call tokens are the last ones, however the text is
cut into tokens."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omlx_logprobs.output.sections import SectionedText, TextDelta
from omlx_logprobs.parsing.tools import Kind, make_parser
from omlx_logprobs.types import ThinkStart, ToolCall, ToolParsing

TEXTS = [
    (
        "hermes",
        'Let me see, x < y. <tool_call>\n{"name": "f", "arguments": {"a": "日本"}}\n</tool_call>',
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
        '"arguments": {"s": "😀"}}</tool_call>\nDone.',
    ),
    ("hermes", 'Try <tool_call>{"name": "f", "arguments": {oops}}</tool_call> again'),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'),
    ("llama3_json", ' {"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'),
]


def run(fmt: str, tokens: list[bytes]) -> tuple[list[tuple[int, int, TextDelta]], int | None]:
    """Each output (first token, end token, delta) as the processor makes them, and the index
    of the first tool-call token."""
    text = SectionedText((), ThinkStart.OFF, make_parser(ToolParsing(fmt)))
    ends, released, outs = array("q"), 0, []
    for b in tokens:
        ends.append((ends[-1] if ends else 0) + len(b))
        text.feed(b)
        end, delta = text.release(ends, released)
        if end > released or delta:
            outs.append((released, end, delta))
            released = end
    outs.append((released, len(ends), text.flush()))
    return outs, text.tool_start(ends)


Layout = tuple[list[Kind], list[tuple[int, ToolCall]], list[tuple[int, int]]]


def layout(fmt: str, raw: bytes) -> Layout:
    """Each byte's piece kind, each call with the offset just past its text, and the calls'
    spans, from the whole text parsed at once."""
    p = make_parser(ToolParsing(fmt))
    pieces = p.feed(raw.decode()) + p.flush()
    kinds, calls, spans, at = [], [], [], 0
    for piece in pieces:
        n = len(piece.text.encode())
        kinds += [piece.kind] * n
        if piece.kind is Kind.CALL:
            spans.append((at, at + n))
            calls += [(at + n, c) for c in piece.calls]
        at += n
    return kinds, calls, spans


def check(fmt: str, tokens: list[bytes]) -> None:
    raw = b"".join(tokens)
    kinds, calls, spans = layout(fmt, raw)
    first = spans[0][0] if spans else None
    outs, tool_start = run(fmt, tokens)
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens) + 1)]
    got_calls = []
    for a, b, delta in outs:
        lo, hi = starts[a], starts[b]
        # content text is exactly the content bytes of this output's tokens
        want = bytes(raw[i] for i in range(lo, hi) if kinds[i] is Kind.CONTENT)
        assert delta.content == want.decode(), (a, b)
        # a call leaves with the token holding its last byte
        assert [c for end, c in calls if lo < end <= hi] == list(delta.calls), (a, b)
        # and its tokens wait for that one: no output ends inside a call
        assert not any(s < hi < e for s, e in spans), (a, b)
        got_calls += delta.calls
    assert got_calls == [c for _, c in calls]
    assert outs[-1][1] == len(tokens)
    if first is None:
        assert tool_start is None
    else:  # the first token whose first byte is at or after the first call's
        want = [i for i in range(len(tokens)) if starts[i] >= first]
        assert tool_start == (want[0] if want else len(tokens))


@pytest.mark.parametrize("fmt, text", TEXTS)
def test_every_tokenization_in_two_and_byte_by_byte(fmt: str, text: str) -> None:
    raw = text.encode()
    for i in range(len(raw) + 1):
        check(fmt, [raw[:i], raw[i:]])
    check(fmt, [raw[i : i + 1] for i in range(len(raw))])
    check(fmt, [raw, b""])  # a token without bytes at the end (the end-of-turn token)


def test_a_token_that_ends_one_call_and_starts_the_next() -> None:
    """The first call's closing token runs into the second call: the first call, and the token
    before, wait until the second call's text is complete."""
    fmt, text = TEXTS[1]
    raw = text.encode()
    a = raw.index(b"<tool_call>", 1)
    check(fmt, [b"", b"<", raw[1 : a + 1], raw[a + 1 :]])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_tokenization(data: st.DataObject) -> None:
    fmt, text = data.draw(st.sampled_from(TEXTS))
    raw = text.encode()
    cuts = sorted(data.draw(st.sets(st.integers(0, len(raw)), max_size=16)))
    check(fmt, [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])])


def test_a_single_call_ends_the_output() -> None:
    parser = make_parser(ToolParsing("hermes", parallel=False))
    text = SectionedText((), ThinkStart.OFF, parser, single_call=True)
    text.feed(b'<tool_call>{"name": "f", "arguments": {}}')
    assert not text.stopped
    text.feed(b"</tool_call>")
    assert text.stopped


def test_every_token_of_a_forced_output_is_a_tool_call_token() -> None:
    """tool_choice required or named: the tool-call section starts at the first token, before
    any call is complete (a call cut by max_tokens is all tool-call tokens)."""
    text = SectionedText((), ThinkStart.OFF, make_parser(ToolParsing("hermes", forced=True)))
    ends = array("q")
    for b in (b"<tool_call>", b'\n{"name": "f", "arg'):
        ends.append((ends[-1] if ends else 0) + len(b))
        text.feed(b)
    assert text.tool_start(ends) == 0
    delta = text.flush()
    assert delta.content == "" and not delta.calls
