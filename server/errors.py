"""OpenAI-shaped error bodies and the exception handlers that guarantee them.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}`; an
unexpected exception becomes a generic 500 body and is logged server-side, so no traceback
ever reaches a response.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("driftgate.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error meant for the client, with its HTTP status and the offending field."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


class ContextLengthError(APIError):
    """A 400 for a prompt (with its max_tokens) that does not fit the model's context."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(400, message, param=param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The JSON body OpenAI clients parse into their exception types."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _is_union_member(part: Any) -> bool:
    """pydantic names the member of a union it tried in the location ("str", "list[constrained-int]")."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict"))


def _field(error: Any) -> Any:
    """The body field a pydantic error concerns (None: the body as a whole)."""
    return next((part for part in error.get("loc", ()) if part != "body"), None)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The most telling pydantic error as one readable line, and the body field it concerns. A field
    that may take several shapes (prompt: text, token ids, lists of either) fails once per shape;
    a value the right shape refused ("at least 1 item", "greater than or equal to 0") says more
    than "Input should be a valid string" from the first shape tried."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is a character offset (if any), not a field
        offset = [part for part in first.get("loc", ()) if isinstance(part, int)]
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"the body is not valid JSON ({reason}{f' at character {offset[0]}' if offset else ''})", None
    same_field = [e for e in errors if _field(e) == _field(first)]
    chosen = next((e for e in same_field if not e.get("type", "").endswith(("_type", "_parsing"))), first)
    loc = [str(part) for part in chosen.get("loc", ()) if part != "body" and not _is_union_member(part)]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {chosen.get('msg', 'invalid value')}", param


def invalid_body(exc: ValidationError) -> APIError:
    """A body a route validates itself, reported as FastAPI's validation is: a 400 naming the field."""
    message, param = _validation_message(exc.errors())
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type FastAPI can raise through `error_body`."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error")
