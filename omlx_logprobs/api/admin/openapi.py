"""The OpenAPI document as the server behaves: a rejected request is a 400 in its API's error
shape (`api/core/errors.py`: OpenAI's, Anthropic's or Ollama's), so FastAPI's generated 422
`HTTPValidationError` is replaced by it.
Swagger UI at /docs: our page (api/static/docs.html) with the assets of the
`swagger-ui-bundle-v2` package, read once at start-up, never a CDN."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from omlx_logprobs.api.admin.page import STATIC, Assets
from omlx_logprobs.api.core.errors import wire
from omlx_logprobs.api.core.protocol import (
    AnthropicErrorResponse,
    ErrorResponse,
    OllamaErrorResponse,
    TinkerErrorResponse,
)

_REF = "#/components/schemas/{model}"
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")
_SWAGGER_DIST = "swagger-ui-bundle-v2"
# Reachable without the API key: Swagger UI holds no data; the document itself (/openapi.json)
# and every call Swagger UI makes carry the key (docs.js adds the one the page keeps).
OPEN_PATHS = frozenset({"/docs", "/docs/LICENSE"})
OPEN_PREFIXES = ("/docs/assets/",)


def install_openapi(app: FastAPI, api_key_required: bool = False) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request) and Swagger
    UI at /docs; with an API key, the document declares bearer authentication."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            spec = with_openai_errors(spec)
            app.openapi_schema = with_bearer(spec) if api_key_required else spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    _install_docs(app)


def _install_docs(app: FastAPI) -> None:
    import swagger_ui_bundle  # Swagger UI 5 (OpenAPI 3.1), Apache-2.0

    swagger = Assets(swagger_ui_bundle.swagger_ui_path, ["swagger-ui-bundle.js", "swagger-ui.css"])
    page = Assets(STATIC, ["docs.html"])
    licence = _swagger_licence()

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return page.response("docs.html")

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def assets(name: str) -> Response:
        return swagger.response(name)

    @app.get("/docs/LICENSE", include_in_schema=False)
    async def licence_text() -> PlainTextResponse:
        return PlainTextResponse(licence)


def _swagger_licence() -> str:
    """Swagger UI's licence as its package installed it."""
    dist = importlib.metadata.distribution(_SWAGGER_DIST)
    for f in dist.files or ():
        if f.name.startswith("LICENSE"):
            return f.read_text()
    return "Swagger UI is distributed under the Apache License 2.0."


def with_bearer(spec: dict[str, Any]) -> dict[str, Any]:
    """Every operation takes `Authorization: Bearer <key>` (the server's --api-key)."""
    schemes = spec.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["apiKey"] = {"type": "http", "scheme": "bearer"}
    spec["security"] = [{"apiKey": []}]
    return spec


def with_openai_errors(spec: dict[str, Any]) -> dict[str, Any]:
    """Every operation that takes input answers 400 with its API's error shape (OpenAI's
    `ErrorResponse`; Anthropic's, Ollama's and Tinker's on their routes); no 422 anywhere."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPI_VALIDATION:
        schemas.pop(name, None)
    shapes: dict[str, type[BaseModel]] = {"openai": ErrorResponse,
                                          "anthropic": AnthropicErrorResponse,
                                          "ollama": OllamaErrorResponse,
                                          "tinker": TinkerErrorResponse}  # fmt: skip
    for model in shapes.values():
        error = model.model_json_schema(ref_template=_REF)
        schemas.update(error.pop("$defs", {}))
        schemas[model.__name__] = error
    for path, operations in spec.get("paths", {}).items():
        ref = {"$ref": _REF.format(model=shapes[wire(path)].__name__)}
        bad_request = {
            "description": "Invalid request: a field, a value out of range or a limit exceeded",
            "content": {"application/json": {"schema": ref}},
        }
        for op in operations.values():
            responses = op.setdefault("responses", {})
            validated = responses.pop("422", None) is not None
            if validated or "requestBody" in op or op.get("parameters"):
                responses["400"] = bad_request
    return spec
