"""The `/v1/responses` body as this server reads it: OpenAI's fields, and vLLM's sampling
extensions it shares with chat. Undeclared fields are kept to be named in the 400 (or the
`X-Ignored-Fields` header), as on the other routes; fields declared only to be refused unless
they ask for nothing are in api/responses/convert.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from omlx_logprobs.api.core.protocol import LogprobsModeName, _Model, _Open

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextFormat(_Model):
    """`text.format`: text, json_object, or json_schema (`name`, `schema`, `strict`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Model):
    """`reasoning`: the effort goes to the chat template (`reasoning_effort`; "none" also turns
    thinking off); summaries are not written (the reasoning text itself is returned)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Open):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0)
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    store: bool | None = None  # OpenAI's default: true
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # With no effect on the answer: ids and labels.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    # Refused unless they ask for nothing (convert.REFUSED says why).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    context_management: list[dict[str, Any]] | None = None
    # vLLM's sampling extensions, as on chat
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logprobs_mode: LogprobsModeName | None = None
    logprobs_format: Literal["openai", "columnar", "base64"] = "openai"
    return_tokens_as_token_ids: bool = False
    return_tail_logprob: bool = False  # as on chat: each entry's tail mass
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        """OpenAI's `include` turns entries on; `top_logprobs` alone does too (a client that
        asks for alternatives wants the entries: they are never silently left out)."""
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None


class CompactRequest(_Open):
    """`POST /v1/responses/compact`: the conversation to compact (`input`, after the stored
    one of `previous_response_id`); `prompt_cache_key` is a label, with no effect here."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
