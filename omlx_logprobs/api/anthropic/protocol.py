"""The `/v1/messages` body as this server reads it: Anthropic's fields, and the logprob and
sampling extensions it shares with chat (Anthropic's API has no logprobs: `logprobs` and
`top_logprobs` are this server's, as on chat). Undeclared fields are kept to be named in the
400 (or the `X-Ignored-Fields` header)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from omlx_logprobs.api.core.protocol import LogprobsModeName, _Model, _Open


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ThinkingConfig(_Model):
    """`enabled` / `adaptive` turn the template's thinking on, `disabled` off; `enabled`'s
    `budget_tokens` is enforced as a thinking budget (batch/budget.py: at the budget the
    model's own closing tag is forced) on a model whose reasoning is parsed."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)
    display: str | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Open):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # this server's extensions, as on chat
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    logprobs_mode: LogprobsModeName | None = None
    seed: int | None = None
    min_p: float = Field(0.0, ge=0, le=1)


class CountTokensRequest(_Open):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
