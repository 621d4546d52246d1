"""The tool-call parsers alone (parsing/tools/), no model: every format's calls, split at every
point, what is held back, malformed calls as content, and the format read off a chat template."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omlx_logprobs.parsing.tools import Kind, Piece, ToolCallFormat, detect_format, make_parser
from omlx_logprobs.types import ToolCall, ToolParsing

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}


def parse(fmt: str, chunks: list[str], tools: tuple[dict[str, Any], ...] = ()) -> list[Piece]:
    p = make_parser(ToolParsing(fmt, tools))
    out: list[Piece] = []
    for c in chunks:
        out += p.feed(c)
    return out + p.flush()


def summary(pieces: list[Piece]) -> tuple[str, list[ToolCall], str]:
    """(content text, calls, framing text)."""
    content = "".join(p.text for p in pieces if p.kind is Kind.CONTENT)
    calls = [c for p in pieces if p.kind is Kind.CALL for c in p.calls]
    framing = "".join(p.text for p in pieces if p.kind is Kind.FRAMING)
    return content, calls, framing


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


# (format, output, content, calls)
CASES = [
    (
        "hermes",
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me check. ",
        [call("get_weather", city="Paris")],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "a", "arguments": {"x": "<tool_call> in a string"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>\n',
        "",
        [call("a", x="<tool_call> in a string"), ToolCall("b", '{"y": 2}')],
    ),
    (
        "hermes",
        'x < y and <tool <b>: <tool_call>{"name": "f", "arguments": {oops}}</tool_call> done',
        'x < y and <tool <b>: <tool_call>{"name": "f", "arguments": {oops}}</tool_call> done',
        [],
    ),
    (  # malformed after a good call: its text is content (the separator before it is not)
        "hermes",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>[1]</tool_call>',
        "<tool_call>[1]</tool_call>",
        [call("f")],
    ),
    (  # text after the calls is content; whitespace between them is framing
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"日本": "東京"}}</tool_call>\n\nDone.',
        "\n\nDone.",
        [call("f", 日本="東京")],
    ),
    (  # cut before its closing tag (a stop string, the end of turn): still a call
        "hermes",
        'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n',
        "ok ",
        [call("f", a=[1, 2])],
    ),
    ("hermes", 'ok <tool_call>\n{"name": "f", "argu', 'ok <tool_call>\n{"name": "f", "argu', []),
    (
        "qwen3_coder",
        "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
        "<parameter=extra>\nx\ny\n</parameter>\n</function>\n</tool_call>",
        "I'll look.\n",
        [
            call(
                "get_weather",
                city="San Francisco",
                days=3,
                metric=True,
                hours=[1, 2],
                note="42",
                extra="x\ny",
            )
        ],
    ),
    (  # a JSON body under the same tags
        "qwen3_coder",
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        "",
        [call("f", a=1)],
    ),
    (
        "qwen3_coder",
        "<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>",
        "<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>",
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "t", "parameters": {}}',
        "",
        [call("get_weather", city="Oslo"), call("t")],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "arguments": {"s": "}{"}}',
        "",
        [call("f", s="}{")],
    ),
    (  # a call only opens the output
        "llama3_json",
        'Sure: {"name": "f", "parameters": {}}',
        'Sure: {"name": "f", "parameters": {}}',
        [],
    ),
    ("llama3_json", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    (
        "mistral",
        'Calling. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "neg", "arguments": {"a": 3}}]',
        "Calling. ",
        [call("add", a=1, b=2), call("neg", a=3)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]neg[CALL_ID]abc123XYZ[ARGS]{"a": 3}',
        "",
        [call("add", a=1, b=2), call("neg", a=3)],
    ),
    ("mistral", "[TOOL_CALLS]add[ARGS]oops", "[TOOL_CALLS]add[ARGS]oops", []),
    ("mistral", "[TOOLS] are [TOOL_CALL", "[TOOLS] are [TOOL_CALL", []),
    (
        "harmony",
        "<|start|>assistant<|channel|>final<|message|>It is 4 < 5.<|return|>",
        "It is 4 < 5.",
        [],
    ),
    (
        "harmony",
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary"
        ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
        "Checking.",
        [call("get_weather", city="Oslo")],
    ),
    (  # the recipient in the role's part of the header; a call cut before <|call|>
        "harmony",
        '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}',
        "",
        [call("f", a=1)],
    ),
    (
        "harmony",
        "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{oops}<|call|>",
        "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{oops}<|call|>",
        [],
    ),
    ("harmony", "no header <|sta", "no header <|sta", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_every_split_gives_the_same_pieces(
    fmt: str, text: str, content: str, calls: list[ToolCall]
) -> None:
    tools = (WEATHER,)
    whole = parse(fmt, [text], tools)
    got = summary(whole)
    assert got[:2] == (content, calls)
    assert "".join(p.text for p in whole) == text  # every character in one piece, in order
    for i in range(len(text) + 1):  # split in two at every point
        assert summary(parse(fmt, [text[:i], text[i:]], tools)) == got, i
    one_char = parse(fmt, list(text), tools)
    assert summary(one_char) == got
    assert "".join(p.text for p in one_char) == text


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_pieces(data: st.DataObject) -> None:
    fmt, text, content, calls = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert summary(parse(fmt, chunks, (WEATHER,)))[:2] == (content, calls)


def test_only_a_possible_start_is_held_back() -> None:
    p = make_parser(ToolParsing("hermes"))
    assert [x.text for x in p.feed("Hello <tool")] == ["Hello "]
    assert [x.text for x in p.feed("s>")] == ["<tools>"]
    assert p.feed("a<") == [Piece(Kind.CONTENT, "a")]
    assert p.feed("tool_call>{") == []  # inside a call: held until it ends
    assert p.feed('"name": "f"}') == []
    [got] = p.feed("</tool_call>")
    assert got.kind is Kind.CALL and got.calls == (ToolCall("f", "{}"),)
    assert p.feed("\n\n") == []  # separators wait for what follows
    assert p.flush() == [Piece(Kind.FRAMING, "\n\n")]


def test_llama3_waits_only_while_the_output_may_open_a_call() -> None:
    p = make_parser(ToolParsing("llama3_json"))
    assert p.feed("  ") == []
    assert p.feed("Hi {") == [Piece(Kind.CONTENT, "  Hi {")]
    assert p.feed('"name": "f"}') == [Piece(Kind.CONTENT, '"name": "f"}')]


def test_harmony_without_calls_keeps_a_call_as_text() -> None:
    text = "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|call|>"
    p = make_parser(ToolParsing("harmony", calls=False))
    assert summary(p.feed(text) + p.flush()) == (text, [], "")


def test_the_format_is_read_off_the_template() -> None:
    def tok(template: Any) -> Any:
        return SimpleNamespace(chat_template=template)

    assert detect_format(tok("{{ '<tool_call>\\n' }}")) is ToolCallFormat.HERMES
    assert detect_format(tok("<tool_call> <function=x>")) is ToolCallFormat.QWEN3_CODER
    assert detect_format(tok("[TOOL_CALLS] {{ x }}")) is ToolCallFormat.MISTRAL
    assert detect_format(tok("{{ '<|python_tag|>' }}")) is ToolCallFormat.LLAMA3_JSON
    assert detect_format(tok({"default": "x", "tool_use": "<tool_call>"})) is (
        ToolCallFormat.HERMES
    )
    harmony = "<|start|>assistant<|channel|>final<|message|>"
    assert detect_format(tok(harmony)) is ToolCallFormat.HARMONY
    assert detect_format(tok("{{ messages }}")) is ToolCallFormat.NONE
    assert detect_format(tok(None)) is ToolCallFormat.NONE


@pytest.mark.parametrize(
    "fmt, cut",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "argu'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_c'),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a"'),
        ("harmony", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"),
    ],
)
def test_a_forced_output_cut_short_is_never_content(fmt: str, cut: str) -> None:
    """A forced call's output is calls by grammar: what max_tokens left unfinished is framing
    (in no field), never content; the calls completed before it stay calls."""
    p = make_parser(ToolParsing(fmt, forced=True))
    pieces = p.feed(cut) + p.flush()
    content, calls, framing = summary(pieces)
    assert content == "" and "".join(x.text for x in pieces) == cut
    assert len(calls) == cut.count("</tool_call>") and framing
    free = make_parser(ToolParsing(fmt))  # the same text under tool_choice auto: content
    assert summary(free.feed(cut) + free.flush())[0]
