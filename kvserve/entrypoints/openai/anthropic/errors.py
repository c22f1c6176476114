"""Anthropic-style error bodies, `{"type": "error", "error": {"type", "message"}}`, for the
Messages API's routes only (the OpenAI routes keep OpenAI's shape). The status decides the
type, as Anthropic's API does; a server that cannot take a request now (loading, too many
in flight, its engine gone) answers 529 overloaded_error, which Anthropic's clients retry.

`AnthropicRoute` gives a router's routes these bodies for everything they raise: pydantic's
validation errors, the engine's typed errors, anything unexpected."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.entrypoints.openai.errors import engine_error_body
from kvserve.errors import KVServeError

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
OVERLOADED = 529
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", OVERLOADED: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether a request path is one of the Messages API's (its errors take this shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_status(status: int) -> int:
    return OVERLOADED if status == 503 else status


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(anthropic_status(status), "api_error"),
                                       "message": message}}


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=anthropic_status(status),
                        headers=headers)


def reshaped(response: JSONResponse) -> JSONResponse:
    """An OpenAI-style error response (the checks every route shares) in Anthropic's shape,
    its headers (Retry-After) kept."""
    message = json.loads(response.body)["error"]["message"]
    headers = {key: value for key, value in response.headers.items()
               if key.lower() not in ("content-length", "content-type")}
    return error_response(response.status_code, message, headers)


def exception_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Anthropic body) for an error raised while serving a request."""
    status, body = engine_error_body(exc)
    return anthropic_status(status), error_body(status, body["error"]["message"])


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one line, each led by the dotted path of its field (as Anthropic
    names fields: messages.0.content.1)."""
    parts = []
    for error in errors[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        if error.get("type") == "extra_forbidden":
            message = ("unrecognized field: this server does not implement it; "
                       "remove it from the request")
        else:
            message = error.get("msg", "invalid")
        parts.append(message if message.startswith(where) else f"{where}: {message}")
    return "; ".join(parts) or "invalid request"


class AnthropicRoute(APIRoute):
    """A route whose errors are Anthropic-shaped, whatever raised them."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return error_response(400, validation_message(exc.errors()))
            except StarletteHTTPException as exc:
                return error_response(exc.status_code, str(exc.detail))
            except Exception as exc:
                if not isinstance(exc, KVServeError):
                    logger.exception("unexpected error")
                status, body = exception_body(exc)
                return JSONResponse(body, status_code=status)

        return guarded
