"""OpenAI-shaped errors: every 4xx/5xx body is ``{"error": {"message", "type", "param", "code"}}``.

Handlers here turn FastAPI's own failures (malformed JSON, validation, unknown routes) and the
engine's ``InvalidRequestError`` into that shape, so no client ever sees a bare HTML or
FastAPI-style ``{"detail": ...}`` body.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.core.sampling_params import InvalidRequestError
from infer.server.protocol import InvalidTextError

logger = logging.getLogger("infer.server")

# OpenAI's error types by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


RETRY_AFTER_S = 1  # the Retry-After of a 429 (seconds)


class APIError(Exception):
    """An error answered with an OpenAI error body and the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: int | str | None = None,
    ) -> None:
        if not message.isascii():  # a lone surrogate echoed back must not break the body
            message = message.encode("utf-8", "replace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.code = code if code is not None else status
        # A full queue clears as requests finish: tell clients when to come back.
        self.headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        merged = {**(self.headers or {}), **(headers or {})} or None
        return JSONResponse(self.body(), status_code=self.status, headers=merged)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_invalid_request(e: InvalidRequestError) -> APIError:
    return APIError(400, e.message, param=e.param)


_TYPE_TAG = re.compile(r"[\[\]()\-,]|^(str|int|float|bool|list|dict|none|is-instance)$")


def _param_path(loc: tuple) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; union tags are dropped."""
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        if _TYPE_TAG.search(str(item)):
            continue
        parts.append(str(item))
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming its field (a JSON syntax error says so)."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        pos = first.get("loc", (None, None))[-1]
        return bad_request(f"malformed JSON body: {detail} at position {pos}".strip())
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidTextError):  # a lone surrogate (before the fields are read)
        return bad_request(str(cause), param=cause.param or None)
    param = _param_path(tuple(first.get("loc", ())))
    if first.get("type") == "model_attributes_type" and param is None:
        return bad_request(
            "the request body must be a JSON object (send Content-Type: application/json)"
        )
    msg = first.get("msg", "invalid value")
    where = f"'{param}'" if param else "the request body"
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"invalid value for {where}: {msg}{extra}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return from_invalid_request(e).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(list(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(e.status_code).phrase
        except ValueError:
            phrase = "error"
        message = e.detail if isinstance(e.detail, str) and e.detail else phrase
        code = "request_too_large" if e.status_code == 413 else None
        error = APIError(e.status_code, message, code=code)
        return error.response(headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        # (what the outer middleware raise; the routes' own: UnexpectedErrorMiddleware)
        logger.exception("unhandled error while serving a request")
        return internal_error(e).response()


def internal_error(e: BaseException) -> APIError:
    """A failure no handler expected, as the 500 a client gets."""
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")
