"""OpenAI's routes (`/v1/chat/completions`, its `/tokens` variant, `/v1/completions`,
`/v1/models`): each request a `Run` on the one request path (api/core/prepare.py), its outputs
written as OpenAI's JSON bodies and chunks."""
