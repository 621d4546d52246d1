"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): a thin adapter onto
the one request path (api/core/prepare.py) and from the engine's outputs onto content blocks and
Anthropic's events (docs/specs/anthropic.md)."""
