"""What every API package shares (api/openai/, responses/, anthropic/, ollama/, rl/, admin/): the
one request path (prepare.py), the checks (validation.py; fields.py, the fields a body may send;
bounds.py, the model's facts they check against), the request models (protocol.py),
the framing of streams (sse.py), each API's error shape (errors.py) and the pool of served
models (pool.py, slot.py, served.py, loading.py) with the route body every generation route
shares (serving.py). It imports no API package."""
