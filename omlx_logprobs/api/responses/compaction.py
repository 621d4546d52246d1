"""The compaction item `POST /v1/responses/compact` returns and a later request's `input` carries.
This server writes no summary: the item holds the compacted conversation whole, as the chat
messages a request reads it into, in JSON and base64 (opaque to the client, as the specification
asks, but not encrypted: the server keeps no key and nothing it has not been sent). Sent back as
input, those messages take the item's place, in order."""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from typing import Any

from omlx_logprobs.api.core.errors import APIError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def pack(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The item holding `messages`."""
    # JSON's \u escapes keep a lone surrogate a client sent (UTF-8 cannot hold one) as it came
    content = base64.b64encode(json.dumps(messages).encode("ascii")).decode()
    return {
        "type": "compaction",
        "id": "cmp_" + secrets.token_hex(12),
        "encrypted_content": content,
    }


def unpack(item: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The messages an item of `pack` holds; a 400 naming `where` for one it did not write."""
    content = item.get("encrypted_content")
    try:
        if not isinstance(content, str):
            raise ValueError("no encrypted_content")
        messages = json.loads(base64.b64decode(content.encode(), validate=True))
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES for m in messages
        ):
            raise ValueError("not a list of messages")
    except (ValueError, binascii.Error) as e:
        raise APIError(
            f"{where}.encrypted_content: not a compaction this server wrote ({e}).",
            param=f"{where}.encrypted_content",
            code="invalid_encrypted_content",
        ) from None
    return messages
