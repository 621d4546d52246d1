"""The scripted model the tool-call tests serve: one script per case, each in a tool-call format,
its segments marked reasoning ("r"), content ("c") or tool-call section ("t"): the tokens of a
segment must come back in that section's logprobs. The tool-call section runs from the first
well-formed call to the end (the end-of-turn token included)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.models.scripted import script_ids
from omlx_logprobs.types import HARMONY_TAGS
from tests.helpers.scripted import THINK, write_description

HARMONY = (*HARMONY_TAGS, "<|call|>", "<|return|>")  # added here as text, each one token

OPEN = {"tokens": ["<tool_call>"]}
CLOSE = {"tokens": ["</tool_call>"]}
END = {"tokens": ["</think>"]}
ADDED = [
    "</think>\n\nThe",
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    *HARMONY,
]


def harmony(*parts: str) -> list[dict[str, Any]]:
    """Harmony text: its markers one token each, the text between tokenized."""
    out: list[dict[str, Any]] = []
    for part in parts:
        out.append({"tokens": [part]} if part in HARMONY else {"text": part})
    return out


ANALYSIS = harmony("<|channel|>", "analysis", "<|message|>", "Paris, so x < y.", "<|end|>")


def body(name: str, args: dict[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCase:
    fmt: str
    segments: list[tuple[str, dict[str, Any]]]
    content: str  # message.content ("" and no calls: ""; calls and no text: null)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reasoning: str = ""


WEATHER = ("get_weather", {"city": "Paris"})
CASES: dict[str, ToolCase] = {
    # first: the script any other last message gets (a tool result, in multi-turn tests)
    "answer": ToolCase(
        "hermes", [("c", {"text": "It is sunny in Paris."})], "It is sunny in Paris."
    ),
    "weather": ToolCase(
        "hermes",
        [
            ("c", {"text": "Let me check."}),
            ("t", OPEN),
            ("t", {"text": "\n" + body(*WEATHER) + "\n"}),
            ("t", CLOSE),
        ],
        "Let me check.",
        [WEATHER],
    ),
    "two": ToolCase(
        "hermes",
        [
            ("t", OPEN),
            ("t", {"text": body("get_weather", {"city": "Oslo"})}),
            ("t", CLOSE),
            ("t", {"text": "\n"}),
            ("t", OPEN),
            ("t", {"text": body("get_time", {"zone": "CET", "utc": False})}),
            ("t", CLOSE),
        ],
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET", "utc": False})],
    ),
    "bad": ToolCase(
        "hermes",
        [
            ("c", {"text": "Try "}),
            ("c", OPEN),
            ("c", {"text": '{"name": "get_weather", "arguments": {city: Paris}}'}),
            ("c", CLOSE),
        ],
        'Try <tool_call>{"name": "get_weather", "arguments": {city: Paris}}</tool_call>',
    ),
    "think": ToolCase(
        "hermes",
        [
            ("r", THINK),
            ("r", {"text": "Maybe "}),
            ("r", OPEN),
            ("r", {"text": " then x < y."}),
            ("r", END),
            ("c", {"text": "\n\n"}),
            ("t", OPEN),
            ("t", {"text": "\n" + body(*WEATHER) + "\n"}),
            ("t", CLOSE),
        ],
        "\n\n",
        [WEATHER],
        reasoning="Maybe <tool_call> then x < y.",
    ),
    "split": ToolCase(
        "hermes",
        [
            ("c", {"bytes": "a <b> "}),
            ("t", {"bytes": "<tool_call>"}),
            ("t", {"bytes": body("get_weather", {"city": "東京"})}),
            ("t", {"bytes": "</tool_call>"}),
        ],
        "a <b> ",
        [("get_weather", {"city": "東京"})],
    ),
    "after": ToolCase(
        "hermes",
        [("t", OPEN), ("t", {"text": body(*WEATHER)}), ("t", CLOSE), ("t", {"text": "\nDone."})],
        "\nDone.",
        [WEATHER],
    ),
    "open": ToolCase(  # the end of turn comes before the closing tag
        "hermes", [("t", OPEN), ("t", {"text": body(*WEATHER)})], "", [WEATHER]
    ),
    "plain": ToolCase("hermes", [("c", {"text": "No tools: x < y."})], "No tools: x < y."),
    "broken": ToolCase(  # a malformed Mistral list: content, as written
        "mistral",
        [
            ("c", {"text": "Ok "}),
            ("c", {"tokens": ["[TOOL_CALLS]"]}),
            ("c", {"text": '[{"name": "add", "arguments": {a: 1}}]'}),
        ],
        'Ok [TOOL_CALLS][{"name": "add", "arguments": {a: 1}}]',
    ),
    "wrong": ToolCase(  # a malformed Llama 3 call: content, as written
        "llama3_json",
        [("c", {"text": '{"name": "get_weather", "parameters": {city: Oslo}}'})],
        '{"name": "get_weather", "parameters": {city: Oslo}}',
    ),
    "mixed": ToolCase(  # a Qwen3-Coder function with text outside its parameters: content
        "qwen3_coder",
        [
            ("c", OPEN),
            ("c", {"text": "\n<function=get_weather>\nParis\n</function>\n"}),
            ("c", CLOSE),
        ],
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
    ),
    "ponder": ToolCase(  # a Qwen3-Coder call after reasoning
        "qwen3_coder",
        [
            ("r", THINK),
            ("r", {"text": "Rome, then."}),
            ("r", END),
            ("c", {"text": "\n\n"}),
            ("t", OPEN),
            ("t", {"text": "\n<function=get_time>\n<parameter=city>\nRome\n</parameter>\n"}),
            ("t", {"text": "</function>\n"}),
            ("t", CLOSE),
        ],
        "\n\n",
        [("get_time", {"city": "Rome"})],
        reasoning="Rome, then.",
    ),
    "forced": ToolCase(  # exactly what the grammar of a forced Hermes call allows
        "hermes",
        [("t", OPEN), ("t", {"text": "\n" + body(*WEATHER) + "\n"}), ("t", CLOSE)],
        "",
        [WEATHER],
    ),
    "list": ToolCase(
        "mistral",
        [
            ("c", {"text": "Ok"}),
            ("t", {"tokens": ["[TOOL_CALLS]"]}),
            ("t", {"text": json.dumps([{"name": "add", "arguments": {"a": 1, "b": 2}}])}),
        ],
        "Ok",
        [("add", {"a": 1, "b": 2})],
    ),
    "leave": ToolCase(  # a forced call's grammar, then text: a forced call ends at "Done"
        "hermes",
        [
            ("t", OPEN),
            ("t", {"text": "\n" + body(*WEATHER) + "\n"}),
            ("t", CLOSE),
            ("t", {"text": "\nDone."}),
        ],
        "\nDone.",
        [WEATHER],
    ),
    "schema": ToolCase(  # an answer in a response_format's schema, beside tools
        "hermes", [("c", {"text": '{"answer": "sunny"}'})], '{"answer": "sunny"}'
    ),
    "args": ToolCase(
        "mistral",
        [
            ("t", {"tokens": ["[TOOL_CALLS]"]}),
            ("t", {"text": "add"}),
            ("t", {"tokens": ["[ARGS]"]}),
            ("t", {"text": '{"a": 1}'}),
            ("t", {"tokens": ["[TOOL_CALLS]"]}),
            ("t", {"text": "neg"}),
            ("t", {"tokens": ["[ARGS]"]}),
            ("t", {"text": '{"a": 2}'}),
        ],
        "",
        [("add", {"a": 1}), ("neg", {"a": 2})],
    ),
    "json": ToolCase(
        "llama3_json",
        [("t", {"text": body("get_weather", {"city": "Oslo"}, "parameters")})],
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    "xml": ToolCase(
        "qwen3_coder",
        [
            ("c", {"text": "Checking."}),
            ("t", OPEN),
            (
                "t",
                {
                    "text": "\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n"
                },
            ),
            ("t", CLOSE),
        ],
        "Checking.",
        [("get_weather", {"city": "Rome", "days": 2})],
    ),
    # gpt-oss's harmony: reasoning is the analysis message, the answer and calls are messages;
    # the end-of-turn token stands for <|return|> and <|call|> (control tokens, no bytes)
    "final": ToolCase(
        "harmony",
        [("r", seg) for seg in ANALYSIS]
        + [
            ("c", seg)
            for seg in harmony(
                "<|start|>",
                "assistant",
                "<|channel|>",
                "final",
                "<|message|>",
                "Four.",
            )
        ],
        "Four.",
        reasoning="Paris, so x < y.",
    ),
    "call": ToolCase(
        "harmony",
        [("r", seg) for seg in ANALYSIS]
        + [("c", seg) for seg in harmony("<|channel|>", "commentary", "<|message|>", "On it.")]
        + [("c", seg) for seg in harmony("<|end|>")]
        + [
            ("t", seg)
            for seg in harmony(
                "<|start|>",
                "assistant",
                "<|channel|>",
                "commentary to=functions.get_weather ",
                "<|constrain|>",
                "json",
                "<|message|>",
                json.dumps(WEATHER[1]),
            )
        ],
        "On it.",
        [WEATHER],
        reasoning="Paris, so x < y.",
    ),
}
HERMES = [n for n, c in CASES.items() if c.fmt == "hermes"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} of a place",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
    for name in ("get_weather", "get_time")
]


def case_ids(model: LoadedModel, name: str) -> tuple[list[int], list[str]]:
    """The case's script ids then the stop token, and each one's section ("r", "c", "t")."""
    case = CASES[name]
    ids: list[int] = []
    sections: list[str] = []
    for section, seg in case.segments:
        more = script_ids([seg], model.tokenizer)
        ids += more
        sections += [section] * len(more)
    eos = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = "t" if "t" in sections else ("r" if sections[-1] == "r" else "c")
    return ids + [eos], sections + [last]


def write_tools_description(path: Path) -> Path:
    scripts = {name: [seg for _, seg in case.segments] for name, case in CASES.items()}
    return write_description(path, name="scripted-tools", added_tokens=ADDED, scripts=scripts)
