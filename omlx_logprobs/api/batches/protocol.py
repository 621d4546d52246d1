"""The body of `POST /v1/batches` (openai/types/batch_create_params.py) and its checks beyond
pydantic's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omlx_logprobs.api.core.errors import APIError


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    # 16 pairs at most, keys of 64 characters and values of 512 at most (OpenAI's bounds).
    metadata: dict[str, Any] | None = Field(None, max_length=16)
    # Accepted: the files this server writes are kept until deleted.
    output_expires_after: dict[str, Any] | None = None


def check_metadata(metadata: dict[str, Any] | None) -> None:
    for key, value in (metadata or {}).items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise APIError(
                "metadata holds strings: keys of 64 characters at most, values of 512.",
                "metadata",
            )
