"""Request models for the OpenAI-compatible API. Chat and completions bodies keep the fields they
do not declare (`model_extra`) so that the server can name them: an unknown field is a 400, as
OpenAI answers, unless the server runs with `--ignore-unknown-fields` (api/core/fields.py). NaN
and Infinity are rejected wherever a number is expected.

Declared are OpenAI's fields and vLLM's that clients send; a few are declared only to be refused
with a reason (features this server does not have), never ignored: see `fields.UNSUPPORTED`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omlx_logprobs.types import MAX_CACHE_SALT, PRIORITY_RANGE


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Open(BaseModel):
    """A body whose undeclared fields are kept, to be named in the 400 (or the header)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    # A data URL, a file:// URL (--allowed-local-media-path) or http(s) (--allow-image-urls).
    url: str
    detail: str | None = None  # OpenAI's; the model's processor decides the resolution


class ImagePart(_Model):
    """An image of a message (models that take images: models/vision.py). `field`: where the
    image was in another API's request (Responses, Anthropic, Ollama), which its 400s name."""

    type: Literal["image_url"]
    image_url: ImageURL
    field: str | None = None


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
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[tuple[int, ImagePart]]:
        """Its image parts, with their index in `content`."""
        if self.content is None or isinstance(self.content, str):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]


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


class StreamOptions(_Open):
    include_usage: bool = False
    # OpenAI pads streamed chunks with random text against length side channels; this server
    # adds no padding whatever the value (the chunks' content is the same).
    include_obfuscation: bool | None = None


LogprobsModeName = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
# vLLM's `priority` (lower is scheduled first; an integer, not "1" nor 1.0) and `cache_salt` (a
# prefix-cache namespace: a non-empty string), bounded (omlx_logprobs/types.py).
Priority = Annotated[int, Field(strict=True, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None


class SamplingKnobs(_Open):
    """What a request asks of the sampler and of the logprobs, whatever carries it: the fields
    chat and text completions share with vLLM's `SamplingParams` (which
    /inference/v1/generate takes as `sampling_params`)."""

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
    # vLLM's scoring and RL extensions
    prompt_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM)
    logprob_token_ids: list[int] | None = None
    logprobs_mode: LogprobsModeName | None = None
    # Each entry's tail mass (logprobs/tail.py): the log of the probability outside its list.
    return_tail_logprob: bool = False
    # vLLM's generation controls
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's slow detokenizer puts spaces around special tokens' text; its fast one (and this
    # server: text is the tokens' own bytes) does not for byte-level BPE: accepted, no effect.
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    structured_outputs: dict[str, Any] | None = None
    # Refused unless they ask for nothing (fields.UNSUPPORTED says why).
    logits_processors: list[Any] | None = None


class SamplingFields(SamplingKnobs):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: no effect on the answer
    return_tokens_as_token_ids: bool = False
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's priority scheduling (lower first) and prefix-cache namespace (docs/specs/rl.md).
    priority: Priority = 0
    cache_salt: CacheSalt = None
    # vLLM's and SGLang's routed experts of a mixture of experts, and a routing to replay on
    # the prompt (api/core/routed_experts.py).
    return_routed_experts: bool = False
    routed_experts: str | list[Any] | None = None
    # Refused unless they ask for nothing (fields.UNSUPPORTED says why).
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search's
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # The compact logprobs form (logprobs/columnar.py): arrays per choice instead of an object
    # per entry, in JSON or as base64 buffers.
    logprobs_format: Literal["openai", "columnar", "base64"] = "openai"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM: prompt_token_ids and choices[].token_ids
    # Every generated token's entry in logprobs.content, in order (reasoning and tool-call
    # tokens too, as vLLM writes them); None: the server's --flat-logprobs, or true when
    # return_token_ids asks for the ids those entries align with (docs/specs/rl.md).
    flat_logprobs: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Continuation (vLLM's names): a trailing assistant message is continued, not answered.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the reply starts with the last message's text when it is the reply's role
    add_special_tokens: bool = False  # BOS and the like on top of what the template writes
    documents: list[dict[str, Any]] | None = None  # for templates with retrieval (vLLM)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's: at most this many reasoning tokens, then the model's closing tag is forced and the
    # answer follows (batch/budget.py); -1 or None: no budget (or --reasoning-budgets' entry
    # for reasoning_effort). An integer: 2.0 or "2" is a 400.
    thinking_token_budget: Annotated[int, Field(strict=True, ge=-1)] | None = None
    # OpenAI fields with no effect on the answer here: ids, metadata, a speed hint.
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    store: bool | None = None
    # The legacy function calling, refused (tools and tool_choice replace it).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Refused unless they ask for nothing.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM; false (leave reasoning out) is refused

    _tools_in_kwargs = model_validator(mode="before")(_template_tools)


class ChatTokensRequest(ChatCompletionRequest):
    """`/v1/chat/completions/tokens` (prime-rl's route, verifiers' token client): a chat
    request whose prompt is `tokens`, the conversation so far as the client holds its ids;
    the messages still name the tools and the reply's role."""

    tokens: list[int] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=-1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    return_token_ids: bool = False  # vLLM: choices[].prompt_token_ids and choices[].token_ids
    add_special_tokens: bool = True  # vLLM: BOS and the like when a prompt is text


class ErrorDetail(BaseModel):
    """What every rejection says (OpenAI's shape); all four keys are always present."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """What every rejection on `/v1/messages` says (Anthropic's shape)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaErrorResponse(BaseModel):
    """What every rejection on `/api/` says (Ollama's shape)."""

    error: str


class TinkerErrorResponse(BaseModel):
    """What every rejection on `/api/v1/` says (Tinker's shape: the SDK raises by `category`)."""

    detail: str
    category: Literal["user", "server"]
