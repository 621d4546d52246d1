"""Frozen, validated configuration for the engine and the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # requests decoded together
    prefill_chunk: int = 512  # prompt tokens per prefill step, so decoding is never starved
    # While a batch decodes, a new prompt waits up to this long for others to prefill with.
    prefill_delay_ms: float = 0.0
    max_top_logprobs: int = 20  # the server cap on top_logprobs
    max_model_len: int | None = None  # None: the model's own context length
    logprobs_mode: str = "raw_logprobs"  # the default of requests that name none

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if not 0 <= self.prefill_delay_ms <= 10_000:
            raise ValueError("prefill_delay_ms must be in [0, 10000]")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ValueError("max_top_logprobs must be in [0, 20]")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError("logprobs_mode must be raw_logprobs or processed_logprobs")


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # an mlx-lm directory or a GGUF file; None: the embedded default
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig = EngineConfig()
