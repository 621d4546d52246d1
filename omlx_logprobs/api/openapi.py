"""The OpenAPI document as the server behaves: a rejected request is a 400 in OpenAI's error
shape (`api/errors.py`), so FastAPI's generated 422 `HTTPValidationError` is replaced by it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from omlx_logprobs.api.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = with_openai_errors(spec)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def with_openai_errors(spec: dict[str, Any]) -> dict[str, Any]:
    """Every operation that takes input answers 400 with `ErrorResponse`; no 422 anywhere."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPI_VALIDATION:
        schemas.pop(name, None)
    error = ErrorResponse.model_json_schema(ref_template=_REF)
    schemas.update(error.pop("$defs", {}))
    schemas[ErrorResponse.__name__] = error
    bad_request = {
        "description": "Invalid request: a field, a value out of range or a limit exceeded",
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
    }
    for operations in spec.get("paths", {}).values():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            validated = responses.pop("422", None) is not None
            if validated or "requestBody" in op or op.get("parameters"):
                responses["400"] = bad_request
    return spec
