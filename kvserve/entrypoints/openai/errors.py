"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvserve.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    KVServeError,
    LoRANotFoundError,
    UnsupportedTokenizerError,
)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param,
                      "code": code or str(status)}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def engine_error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI-style body) for an error raised while serving a request."""
    if isinstance(exc, ContextLengthExceededError):
        return 400, error_body(400, str(exc), exc.param, "context_length_exceeded")
    if isinstance(exc, LoRANotFoundError):
        return 404, error_body(404, str(exc), exc.param, "model_not_found")
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(400, str(exc), exc.param, "invalid_request")
    if isinstance(exc, UnsupportedTokenizerError):
        return 400, error_body(400, str(exc), None, "unsupported")
    if isinstance(exc, EngineDeadError):
        return 503, error_body(503, str(exc), None, "engine_unavailable")
    if isinstance(exc, KVServeError):
        return 500, error_body(500, str(exc), None, "engine_error")
    return 500, error_body(500, f"internal error: {type(exc).__name__}", None, "internal_error")


def response_for_engine_error(exc: KVServeError) -> JSONResponse:
    status, body = engine_error_body(exc)
    return JSONResponse(body, status_code=status)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Condense pydantic's error list into one readable line and the first offending field."""
    parts, param = [], None
    for error in errors[:5]:
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        if param is None and location:
            param = location[0]
        name = ".".join(location) or "body"
        kind = error.get("type")
        if kind == "extra_forbidden":
            parts.append(f"unrecognized request argument {name!r}: this server does not "
                         f"implement it; remove it from the request")
        elif kind == "not_implemented":  # the message names the field
            parts.append(error.get("msg", f"{name} is not supported"))
        else:
            parts.append(f"{name}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param
