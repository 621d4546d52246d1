"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`): a thin adapter onto the one request path (api/core/prepare.py) and from the
engine's outputs onto Ollama's NDJSON chunks (docs/specs/ollama.md)."""
