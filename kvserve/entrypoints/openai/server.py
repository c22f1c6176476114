"""The OpenAI-compatible server: the FastAPI app (middleware, error handlers and the routers of
`routes/`) over an AsyncEngine, run by uvicorn.

The HTTP side binds first and answers /health with 503 while the engine thread loads and warms
up the model. Bad input never reaches the engine: pydantic and `prepare` reject it with a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.entrypoints.openai.anthropic import errors as anthropic_errors
from kvserve.entrypoints.openai.errors import (
    error_response,
    response_for_engine_error,
    validation_message,
)
from kvserve.entrypoints.openai.reasoning.parser import template_warnings
from kvserve.entrypoints.openai.responses.store import ResponseStore
from kvserve.entrypoints.openai.routes import ROUTERS
from kvserve.entrypoints.openai.routes.context import TENANT_SCOPE_KEY
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.entrypoints.openai.webui import install_webui, is_webui_path
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.lora_request import LoRARequest

__all__ = ["ServerConfig", "build_app", "run_server"]

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvserve", version=__version__)
    app.state.engine = engine
    app.state.config = config
    app.state.responses = ResponseStore(config.max_stored_responses)
    _install_middleware(app, config)
    _install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if config.webui:
        install_webui(app)
    return app


# ---- middleware ----------------------------------------------------------------------------
def _install_middleware(app: FastAPI, config: ServerConfig) -> None:
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_request_body_bytes, public_webui=config.webui)


class GuardMiddleware:
    """API key and body-size checks as plain ASGI, so streaming and disconnect detection pass
    through untouched (Starlette's BaseHTTPMiddleware wraps `receive` and hides disconnects).

    The key is compared as SHA-256 digests with `hmac.compare_digest`: constant time, and the
    length of the key does not leak either. It comes as `Authorization: Bearer <key>`, or as
    `x-api-key: <key>` (Anthropic's header). With several keys (one per tenant), every key is
    compared, and the request's scope names its tenant (TENANT_SCOPE_KEY, a digest of the key):
    tenants never share prefix-cache blocks (routes/context.py `cache_salt`). The body is read
    here, before any route runs, so a limit holds for chunked uploads without a Content-Length
    too; it is then replayed to the app. /health, and the web page's own files with
    `public_webui`, need no key: they hold no data.
    """

    def __init__(self, app, api_key: str | tuple[str, ...] | None, max_body_bytes: int,
                 public_webui: bool = False):
        self.app = app
        self.expected = [_digest(f"Bearer {key}".encode()) for key in api_keys(api_key)]
        self.max_body_bytes = max_body_bytes
        self.public_webui = public_webui

    def _public(self, path: str) -> bool:
        return path == "/health" or (self.public_webui and is_webui_path(path))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected and not self._public(scope.get("path", "")):
            tenant = self._tenant(headers.get(b"authorization", b""))
            if tenant is None and b"x-api-key" in headers:  # Anthropic's clients' header
                tenant = self._tenant(b"Bearer " + headers[b"x-api-key"])
            if tenant is None:
                response = _error(scope, 401, "invalid or missing API key: send "
                                  "'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                                  "invalid_api_key")
                return await response(scope, receive, send)
            if len(self.expected) > 1:
                scope[TENANT_SCOPE_KEY] = tenant
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        body, complete = await self._read_body(receive)
        if body is None:
            return await self._too_large(scope, receive, send)
        if not complete:
            return  # the client left while sending its request
        return await self.app(scope, _replay(body, receive), send)

    def _tenant(self, authorization: bytes) -> str | None:
        """The matching key's tenant name, or None; every key is compared, so the time taken
        does not say which one matched."""
        given = _digest(authorization)
        matched = None
        for expected in self.expected:
            if hmac.compare_digest(given, expected):
                matched = expected
        return None if matched is None else _digest(b"tenant" + matched).hex()[:16]

    async def _read_body(self, receive) -> tuple[bytes | None, bool]:
        """(body, complete); body is None when over the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    async def _too_large(self, scope, receive, send):
        response = _error(scope, 413, f"request body over {self.max_body_bytes} bytes",
                          "request_too_large", headers={"Connection": "close"})
        return await response(scope, receive, send)


def _error(scope, status: int, message: str, code: str, headers: dict | None = None):
    """An error body in the shape of the API the path belongs to (Anthropic's Messages API or
    OpenAI's)."""
    if anthropic_errors.speaks_anthropic(scope.get("path", "")):
        return anthropic_errors.error_response(status, message, headers)
    return error_response(status, message, code=code, headers=headers)


def api_keys(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """--api-key's keys (one string, or one per tenant)."""
    if not value:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _replay(body: bytes, receive):
    """An ASGI `receive` that gives the buffered body once, then the real channel (so a later
    disconnect is still seen)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(KVServeError)
    async def on_engine_error(_: Request, exc: KVServeError):
        return response_for_engine_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        if anthropic_errors.speaks_anthropic(request.url.path):  # a 404 or 405 there
            return anthropic_errors.error_response(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}")


# ---- running -------------------------------------------------------------------------------
def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would
        die by the signal; we finish the shutdown ourselves and exit 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return GracefulServer


# uvicorn's own deadline, after ours: the handlers need a moment to send their error bodies
_SHUTDOWN_MARGIN_SECONDS = 2.0
# After the engine dies the server answers 503 this long before it stops listening, so a health
# probe sees it unhealthy rather than only gone (seen: a probe in flight across the death got no
# answer at all when the exit began within one poll).
_DEAD_ENGINE_DRAIN_SECONDS = 1.0


def _publishing_kv_events(engine_config):
    """A server publishes its KV events unless told how (--kv-events-config): on free loopback
    ports, announced at /kv_events_info, so `kvserve router` in front of plain replicas routes
    by what they cache. Off without prefix caching (nothing is ever cached)."""
    if engine_config.kv_events_config is not None or not engine_config.enable_prefix_caching:
        return engine_config
    from kvserve.kv_events import with_kv_events

    return with_kv_events(engine_config, "127.0.0.1")


def parse_lora_modules(modules: tuple[str, ...] | None,
                       base_names: tuple[str | None, ...] = ()) -> list[LoRARequest]:
    """--lora-modules' items in vLLM's two forms: name=path, or a JSON object with "name" and
    "path" and optionally "base_model_name", which must then be one of `base_names` (the
    served model: one base here)."""
    requests = []
    for item in modules or ():
        name, path = _lora_module(item, base_names)
        requests.append(LoRARequest(name, len(requests) + 1, path))
    return requests


def _lora_module(item: str, base_names: tuple[str | None, ...]) -> tuple[str, str]:
    if item.startswith("{"):
        try:
            fields = json.loads(item)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"--lora-modules {item!r}: {error}",
                                      param="lora_modules") from error
        unknown = set(fields) - {"name", "path", "base_model_name"}
        if unknown:
            raise InvalidRequestError(f"--lora-modules {item!r}: unknown field(s) "
                                      f"{', '.join(sorted(unknown))}", param="lora_modules")
        name, path = str(fields.get("name") or ""), str(fields.get("path") or "")
        base = fields.get("base_model_name")
        if base is not None and base not in base_names:
            raise InvalidRequestError(f"--lora-modules {item!r}: base_model_name {base!r} is "
                                      "not the served model", param="lora_modules")
    else:
        name, _, path = (part.strip() for part in item.partition("="))
    if not name or not path:
        raise InvalidRequestError(f"--lora-modules {item!r}: expected name=path or "
                                  '{"name": ..., "path": ...}', param="lora_modules")
    return name, path


def run_server(engine_config, server_config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT. In-flight requests get `shutdown_timeout` seconds to finish;
    those still running then get a clean error (a 503 body, or an SSE error event and [DONE])
    before uvicorn closes their connections, and the process exits 0."""
    import uvicorn

    _GracefulServer = _graceful_server_class()
    engine_config = _publishing_kv_events(engine_config)
    engine = AsyncEngine(engine_config, server_config.served_model_name,
                         restart_on_failure=server_config.restart_engine_on_failure,
                         max_restarts=server_config.max_engine_restarts,
                         lora_modules=parse_lora_modules(
                             server_config.lora_modules,
                             (server_config.served_model_name, engine_config.model)))
    app = build_app(engine, server_config)
    uv_config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                               log_level="info", access_log=not server_config.disable_log_requests,
                               timeout_graceful_shutdown=server_config.shutdown_timeout
                               + _SHUTDOWN_MARGIN_SECONDS)
    server = _GracefulServer(uv_config)
    exit_code = 0

    async def watch_engine():
        nonlocal exit_code
        template_checked = False
        while not server.should_exit:
            if not template_checked and engine.is_ready:
                template_checked = True
                for warning in template_warnings(server_config.reasoning_parser,
                                                 engine.inputs.tokenizer.chat_template):
                    logger.warning("%s", warning)
            if engine.startup_error is not None:
                logger.error("engine failed to start: %s", engine.startup_error)
                exit_code = 1
                server.should_exit = True
            elif engine.fatal_error is not None:
                # its streams have their errors already; exit so an orchestrator restarts us
                logger.error("engine core died: %s; exiting", engine.fatal_error)
                exit_code = 1
                await asyncio.sleep(_DEAD_ENGINE_DRAIN_SECONDS)
                server.should_exit = True
            await asyncio.sleep(0.2)
        await asyncio.sleep(server_config.shutdown_timeout)
        if engine.num_unfinished:
            logger.warning("shutdown grace period over: failing %d requests in flight",
                           engine.num_unfinished)
            engine.fail_all(EngineDeadError("the server is shutting down"))

    async def main():
        engine.start()
        watcher = asyncio.ensure_future(watch_engine())
        try:
            await server.serve()
        finally:
            watcher.cancel()
            engine.stop()

    asyncio.run(main())
    return exit_code
