"""Tool calls apart from the answer: incremental parsers of the common formats, one frame
(parser.py) and a small class per format (formats.py), chosen from the chat template or by
`--tool-call-parser`."""

from __future__ import annotations

from enum import Enum
from typing import Any

from omlx_logprobs.parsing.tools.formats import Hermes, Llama3Json, Mistral, Qwen3Coder
from omlx_logprobs.parsing.tools.harmony import Harmony
from omlx_logprobs.parsing.tools.parser import Kind, Piece, ToolCallParser
from omlx_logprobs.types import ToolParsing

__all__ = [
    "Kind",
    "Piece",
    "ToolCallFormat",
    "ToolCallParser",
    "detect_format",
    "make_parser",
    "resolve_format",
]


class ToolCallFormat(str, Enum):
    """`--tool-call-parser`: auto (from the chat template), a format, or none."""

    AUTO = "auto"
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    HARMONY = "harmony"
    NONE = "none"


_PARSERS: dict[str, type[ToolCallParser]] = {
    ToolCallFormat.HERMES.value: Hermes,
    ToolCallFormat.QWEN3_CODER.value: Qwen3Coder,
    ToolCallFormat.LLAMA3_JSON.value: Llama3Json,
    ToolCallFormat.MISTRAL.value: Mistral,
}


def make_parser(spec: ToolParsing) -> ToolCallParser:
    if spec.parser == ToolCallFormat.HARMONY.value:
        parser: ToolCallParser = Harmony(spec.tools, calls=spec.calls)
    else:
        parser = _PARSERS[spec.parser](spec.tools)
    parser.forced = spec.forced
    return parser


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        return " ".join(str(v) for v in template.values())
    return str(template)


def detect_format(tokenizer: Any) -> ToolCallFormat:
    """The format the chat template teaches the model, from what it writes; NONE when the
    template shows no tool calls."""
    t = _template_text(tokenizer)
    if "<|channel|>" in t and "<|message|>" in t:
        return ToolCallFormat.HARMONY
    if "<tool_call>" in t:
        return ToolCallFormat.QWEN3_CODER if "<function=" in t else ToolCallFormat.HERMES
    if "[TOOL_CALLS]" in t:
        return ToolCallFormat.MISTRAL
    if "<|python_tag|>" in t or "respond with a JSON for a function call" in t:
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.NONE


def resolve_format(mode: ToolCallFormat, tokenizer: Any) -> ToolCallFormat:
    """The server's format: auto resolved once, from the chat template."""
    return detect_format(tokenizer) if mode is ToolCallFormat.AUTO else mode
