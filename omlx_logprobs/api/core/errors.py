"""Errors in each API's own shape: OpenAI's `{"error": {message, type, param, code}}` (every
route but these three), Anthropic's `{"type": "error", "error": {type, message}}` (`/v1/messages`),
Tinker's `{"detail": message, "category": "user" or "server"}` (`/api/v1/`, which its SDK raises
as `BadRequestError` and the like) and Ollama's `{"error": message}` (the rest of `/api/`).
The path decides, so a body that fails pydantic, a missing key or an unknown model is answered
in the shape its client parses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = (
            message,
            param,
            status,
            code,
            type_,
        )


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error types by HTTP status (its API reference, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def wire(path: str) -> str:
    """Which API a path belongs to, for the shape of its errors."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/v1/"):
        return "tinker"
    return "ollama" if path.startswith("/api/") else "openai"


def shaped_body(e: APIError, path: str) -> dict[str, Any]:
    """The error body the API at `path` answers with."""
    # A message may quote request text; a lone surrogate in it must not break the error itself.
    message = e.message.encode("utf-8", "replace").decode("utf-8")
    param = e.param.encode("utf-8", "replace").decode("utf-8") if e.param else e.param
    if wire(path) == "anthropic":
        kind = ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else e.type)
        text = f"{param}: {message}" if param and not message.startswith(param) else message
        return {"type": "error", "error": {"type": kind, "message": text}}
    if wire(path) == "tinker":
        return {"detail": message, "category": "server" if e.status >= 500 else "user"}
    if wire(path) == "ollama":
        return {"error": message}
    return error_body(message, e.type, param, e.code)


def error_response(e: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(shaped_body(e, path), status_code=e.status)


def _param(loc: tuple[Any, ...]) -> str | None:
    # Only the first part names where the value was (a body field may be called `query`).
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    out = ""
    for p in parts:
        p = p if p != "" else '""'  # a key that is the empty string is named, not dropped
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def invalid_body(errors: Sequence[Any]) -> APIError:
    """The 400 of a body that fails its pydantic model, naming the first field at fault (the
    batch runner shapes a line's body the same: api/batches/dispatch.py)."""
    err = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    param = _param(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid request"))
    if err.get("type") == "json_invalid":
        msg, param = "The request body is not valid JSON.", None
    elif param is None:  # the body as a whole: not an object, or not sent as JSON
        msg = f"The request body must be a JSON object sent as application/json ({msg})."
    text = f"{param}: {msg}" if param else msg
    return APIError(text, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(r: Request, e: APIError) -> JSONResponse:
        return error_response(e, r.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(r: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(invalid_body(e.errors()), r.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(r: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        err = APIError(str(e.detail), status=e.status_code, type_=type_)
        return error_response(err, r.url.path)

    @app.exception_handler(Exception)
    async def _crash(r: Request, e: Exception) -> JSONResponse:
        err = APIError(f"internal error: {type(e).__name__}", status=500, type_="server_error")
        return error_response(err, r.url.path)
