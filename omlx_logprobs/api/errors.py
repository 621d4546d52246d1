"""OpenAI-shaped errors: every rejection is `{"error": {message, type, param, code}}`."""

from __future__ import annotations

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


def error_response(e: APIError) -> JSONResponse:
    # A message may quote request text; a lone surrogate in it must not break the error itself.
    message = e.message.encode("utf-8", "replace").decode("utf-8")
    param = e.param.encode("utf-8", "replace").decode("utf-8") if e.param else e.param
    return JSONResponse(error_body(message, e.type, param, e.code), status_code=e.status)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        p = p if p != "" else '""'  # a key that is the empty string is named, not dropped
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        param = _param(tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid request"))
        if err.get("type") == "json_invalid":
            msg, param = "The request body is not valid JSON.", None
        elif param is None:  # the body as a whole: not an object, or not sent as JSON
            msg = f"The request body must be a JSON object sent as application/json ({msg})."
        text = f"{param}: {msg}" if param else msg
        return error_response(APIError(text, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(APIError(str(e.detail), status=e.status_code, type_=type_))

    @app.exception_handler(Exception)
    async def _crash(_: Request, e: Exception) -> JSONResponse:
        return error_response(
            APIError(f"internal error: {type(e).__name__}", status=500, type_="server_error")
        )
