"""OpenAI's Responses API (`/v1/responses`): a thin adapter onto the one request path
(api/core/prepare.py) and from the engine's outputs onto Responses' items and events
(docs/specs/responses.md)."""
