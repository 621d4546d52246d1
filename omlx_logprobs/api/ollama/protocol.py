"""Ollama's request bodies as this server reads them. Undeclared fields are kept to be named in
the 400 (or the `X-Ignored-Fields` header); `options` are read in convert.py (Ollama's runtime
options mapped to sampling, its load-time ones accepted with no effect)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt

from omlx_logprobs.api.core.protocol import _Model, _Open


class OllamaFunction(_Model):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(_Model):
    function: OllamaFunction
    id: str | None = None


class OllamaMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Open):
    model: str
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


class OllamaChatRequest(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None


class OllamaEmbedRequest(_Open):
    """`/api/embed`: `input` absent or empty loads the model and embeds nothing (Ollama's way
    to preload one); `truncate` (default true) cuts inputs to the context, else a 400."""

    model: str
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: StrictInt | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbeddingsRequest(_Open):
    """The older `/api/embeddings`: one `prompt` (empty: the model loaded, no vector)."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaShowRequest(_Open):
    model: str = ""
    name: str | None = None  # older clients' name for model
    verbose: bool | None = None
