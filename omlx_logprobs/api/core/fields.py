"""Which fields a request body may send, checked before any other (api/core/validation.py
holds the rest): a field its model does not declare is a 400 naming it (OpenAI's "Unrecognized
request argument"), or with `--ignore-unknown-fields` a name for the log and the response
header; a declared field this server cannot honour is refused with a reason whenever it asks for
something (`UNSUPPORTED`); text that is not Unicode is refused wherever it sits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from omlx_logprobs.api.core.constraints import given
from omlx_logprobs.api.core.errors import APIError

# Objects inside a body whose own unknown fields are named too.
NESTED_BODIES = ("stream_options", "sampling_params")


@dataclass(frozen=True)
class Unsupported:
    """A declared field this server cannot honour: refused whenever `asks` holds for its value
    (the value that asks for nothing passes: `store: false`, `tools: []`), never ignored."""

    field: str
    asks: Callable[[Any], bool]
    why: str
    soon: bool = False  # being built: "not supported yet"


UNSUPPORTED: tuple[Unsupported, ...] = (
    # What this server does not do.
    Unsupported("functions", given, "legacy function calling (send tools)"),
    Unsupported(
        "function_call",
        lambda v: v not in (None, "none", "auto"),
        "legacy function calling (send tool_choice)",
    ),  # fmt: skip
    Unsupported("use_beam_search", given, "beam search"),
    Unsupported("length_penalty", lambda v: v != 1, "beam search (length_penalty)"),
    Unsupported("include_reasoning", lambda v: v is False, "leaving reasoning out"),
    Unsupported("moderation", given, "moderation"),
    Unsupported("logits_processors", given, "custom logits processors"),
    Unsupported("kv_transfer_params", given, "KV transfer"),
    Unsupported("vllm_xargs", given, "vllm_xargs"),
    Unsupported("modalities", lambda v: v is not None and set(v) != {"text"}, "non-text output"),
    Unsupported("audio", given, "audio output"),
    Unsupported("web_search_options", given, "web search"),
    Unsupported("verbosity", lambda v: v not in (None, "medium"), "verbosity"),
    Unsupported("store", given, "stored completions (store: true)"),
    Unsupported(
        "service_tier", lambda v: v not in (None, "auto", "default"), "service tiers but default"
    ),
    Unsupported("chat_template", given, "a chat template sent with the request"),
    Unsupported("mm_processor_kwargs", given, "multimodal input"),
    Unsupported("image_data", given, "multimodal input"),
    Unsupported("video_data", given, "multimodal input"),
    Unsupported("audio_data", given, "multimodal input"),
    Unsupported("input_embeds", given, "input embeddings"),
    Unsupported("return_hidden_states", given, "hidden states"),
    Unsupported("session_params", given, "sessions"),
    Unsupported("custom_params", given, "custom logit processors"),
)


def unknown_fields(req: BaseModel) -> list[str]:
    """The fields a body sent that its model does not declare, as paths (`sampling_params.x`);
    message contents are not looked into (their extra keys are the template's)."""
    found = [str(k) for k in (req.model_extra or {})]
    for name in NESTED_BODIES:
        inner = getattr(req, name, None)
        for i, part in enumerate(inner if isinstance(inner, list) else [inner]):
            if isinstance(part, BaseModel):
                at = f"{name}[{i}]" if isinstance(inner, list) else name
                found += [f"{at}.{k}" for k in (part.model_extra or {})]
    return found


def check_unknown(req: BaseModel, ignore: bool) -> list[str]:
    """A 400 naming the first unknown field (OpenAI's "Unrecognized request argument"), or,
    with `ignore`, the list of them for the log and the response header."""
    found = unknown_fields(req)
    if found and not ignore:
        name = found[0]
        raise APIError(
            f"Unrecognized request argument supplied: {name}",
            param=name or '""',
            code="unknown_parameter",
        )
    return found


def first_unencodable(value: Any, path: str) -> str | None:
    """The path of the first string that cannot be UTF-8 (JSON lets `\\ud800` through)."""
    for p, s in _strings(value, path):
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                return p or "body"
    return None


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        items = {**value.__dict__, **(value.model_extra or {})}
        for k, v in items.items():
            yield from _strings(v, f"{path}.{k}" if path else k)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k, path)
            yield from _strings(v, f"{path}.{k}" if path else str(k))
