"""Request models for the OpenAI-compatible API. Unknown fields are ignored, as vLLM does;
NaN and Infinity are rejected wherever a number is expected."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Model):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


def _template_tools(data: Any) -> Any:
    """`tools` given inside chat_template_kwargs (a list) are the request's tools when it has
    none of its own: rendered by the template and parsed from the output alike. Anything else
    there stays, for the template keywords' check to refuse."""
    if not isinstance(data, dict):
        return data
    kwargs = data.get("chat_template_kwargs")
    if (
        isinstance(kwargs, dict)
        and isinstance(kwargs.get("tools"), list)
        and data.get("tools") is None
    ):
        data = {**data, "tools": kwargs["tools"]}
        data["chat_template_kwargs"] = {k: v for k, v in kwargs.items() if k != "tools"}
    return data


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingFields(_Model):
    """Fields shared by chat and (later) text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's scoring and RL extensions, on both endpoints
    prompt_logprobs: int | None = Field(None, ge=0)
    logprob_token_ids: list[int] | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    return_tokens_as_token_ids: bool = False
    # The compact logprobs form (logprobs/columnar.py): arrays per choice instead of an object
    # per entry, in JSON or as base64 buffers.
    logprobs_format: Literal["openai", "columnar", "base64"] = "openai"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM: prompt_token_ids and choices[].token_ids
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    _tools_in_kwargs = model_validator(mode="before")(_template_tools)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    return_token_ids: bool = False  # vLLM: choices[].prompt_token_ids and choices[].token_ids


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    _tools_in_kwargs = model_validator(mode="before")(_template_tools)


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class UpdateWeightsRequest(_Model):
    """SGLang's `/update_weights_from_disk` body, with `abort_in_flight` (SGLang:
    `abort_all_requests`) and `weight_version` as the caller's tag for the new weights."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None  # the served model whose weights change (its name)
    model_path: str = Field(min_length=1)
    abort_in_flight: bool = False
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None


class ErrorDetail(BaseModel):
    """What every rejection says (OpenAI's shape); all four keys are always present."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
