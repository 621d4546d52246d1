"""Request models of the RL routes (docs/specs/rl.md): vLLM's `/inference/v1/generate` and
SGLang's `/generate` bodies, vLLM's tokenizer bodies, and the bodies of the weight, LoRA and
pause routes. Like every body, NaN and Infinity are rejected wherever a number is expected."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from omlx_logprobs.api.core.protocol import (
    CacheSalt,
    ChatMessage,
    LogprobsModeName,
    Priority,
    SamplingKnobs,
    StreamOptions,
    Tool,
    _Model,
    _Open,
    _template_tools,
)


class GenerateSampling(SamplingKnobs):
    """vLLM's `SamplingParams` as /inference/v1/generate takes them: `logprobs` is the top
    count (0: only the sampled token's entry; None: no entries), `max_tokens` None takes
    the rest of the context (vLLM's server default on this route)."""

    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=-1)
    detokenize: bool = True  # ids and entries are the answer; no text is returned anyway
    # vLLM's storage of the entries (one flat list each): the JSON is the same either way
    flat_logprobs: bool = False
    output_kind: int | None = None  # vLLM's engine-side detail (the route sets it itself)


class PlaceholderRange(_Model):
    """One image's placeholder tokens in the prompt (vLLM's `PlaceholderRangeInfo`)."""

    offset: int = Field(ge=0)
    length: int = Field(ge=1)


class MultiModalFeatures(_Model):
    """vLLM's `features` of /inference/v1/generate, as its render route answers them: per
    modality, each item's hash and placeholder range. `kwargs_data` (vLLM's serialized
    tensors) and `mm_metadata` are not read: an image is found by its hash among those this
    server read (api/core/kept_images.py)."""

    mm_hashes: dict[str, list[str]] = Field(default_factory=dict)
    mm_placeholders: dict[str, list[PlaceholderRange]] = Field(default_factory=dict)
    kwargs_data: dict[str, list[str | None]] | None = None
    mm_metadata: dict[str, list[str | None]] | None = None


class GenerateRequest(_Open):
    """vLLM's `/inference/v1/generate` body (its tokens-in, tokens-out route): prompt ids and
    sampling params, no chat template, no text."""

    model: str | None = None
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(
        default_factory=lambda: GenerateSampling.model_validate({})
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's priority scheduling (lower first) and prefix-cache namespace (docs/specs/rl.md).
    cache_salt: CacheSalt = None
    priority: Priority = 0
    # Routed experts and a routing to replay, as on the completions routes
    # (api/core/routed_experts.py).
    return_routed_experts: bool = False
    routed_experts: str | list[Any] | None = None
    # Images by their hashes and placeholder ranges (api/rl/features.py).
    features: MultiModalFeatures | None = None
    # Refused unless it asks for nothing (fields.UNSUPPORTED says why).
    kv_transfer_params: dict[str, Any] | None = None


class SglangSampling(_Open):
    """SGLang's `sampling_params` (its names and defaults: 128 new tokens, top_k -1)."""

    max_new_tokens: int | None = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # the matched stop string stays in the text
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    n: int = Field(1, ge=1)
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stream_interval: int | None = None  # how often SGLang streams: every output here
    # Refused unless they ask for nothing (fields.UNSUPPORTED says why).
    custom_params: dict[str, Any] | None = None


class SglangGenerateRequest(_Open):
    """SGLang's `/generate` body (slime, Miles): one prompt or a batch, as `text` or
    `input_ids`; each per-prompt field is a value for all or a list with one per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1  # -1: the last prompt token (output tokens only)
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str] | None = None  # a loaded LoRA adapter's name
    model: str | None = None  # which served model (this server's extension)
    logprobs_mode: LogprobsModeName = "processed_logprobs"  # SGLang's: after temperature
    # meta_info.routed_experts of a mixture of experts (api/core/routed_experts.py)
    return_routed_experts: bool = False
    # Refused unless they ask for nothing (fields.UNSUPPORTED says why).
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    return_hidden_states: bool = False
    session_params: dict[str, Any] | None = None

    @property
    def served_name(self) -> str | None:
        """The served name it runs on: `model`, else its adapter's (whose base serves it)."""
        lora = self.lora_path
        if isinstance(lora, list):  # one a prompt: the first names the model ([] names none)
            lora = lora[0] if lora else None
        return self.model or lora


class TokenizeRequest(_Open):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False  # vLLM: `token_strs`, each id's token as the vocabulary has it

    _tools_in_kwargs = model_validator(mode="before")(_template_tools)


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]


class UpdateWeightsRequest(_Model):
    """SGLang's `/update_weights_from_disk` body, with `abort_in_flight` (SGLang:
    `abort_all_requests`) and `weight_version` as the caller's tag for the new weights."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None  # the served model whose weights change (default: the first)
    model_path: str = Field(min_length=1)
    abort_in_flight: bool = False
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None


class PauseGenerationRequest(_Model):
    """SGLang's `/pause_generation` body."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsDirRequest(_Model):
    """prime-rl's `/update_weights` body: the directory of the new weights (the same files as
    /update_weights_from_disk takes), and optionally their tag and which model."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    weight_dir: str = Field(min_length=1)
    weight_version: str | None = None
    model: str | None = None


class LoadLoRAAdapterRequest(_Model):
    """vLLM's `/v1/load_lora_adapter` body: an mlx-lm adapter directory served under a name;
    `load_inplace` replaces a loaded one of that name; `base_model_name` the served model it
    adapts (default: the first)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(_Model):
    """vLLM's `/v1/unload_lora_adapter` body."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    lora_name: str = Field(min_length=1)


class CollectiveRpcRequest(_Model):
    """vLLM's `/collective_rpc` body: a worker method by name, its arguments, and how long the
    caller waits (seconds; None: as long as it takes)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)
