"""The OpenAI-compatible server: FastAPI routes over an AsyncEngine, run by uvicorn.

The HTTP side binds first and answers /health with 503 while the engine thread loads and warms
up the model. Bad input never reaches the engine: pydantic and `prepare` reject it with a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.errors import (
    error_response,
    response_for_engine_error,
    validation_message,
)
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.kv_events import kv_events_info
from kvserve.options import option as _opt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to bind (loopback unless told otherwise)")
    port: int = _opt(8000, "port to listen on")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on every route but "
                               "/health")
    served_model_name: str | None = _opt(None, "model name clients use (default: the model's)")
    max_waiting_requests: int = _opt(1024, "reject new requests with 503 beyond this many "
                                     "unfinished ones")
    max_request_body_bytes: int = _opt(16 * 2**20, "larger request bodies get 413")
    shutdown_timeout: float = _opt(30.0, "seconds in-flight requests get to finish on SIGTERM")
    disable_log_requests: bool = _opt(False, "do not log each request")
    restart_engine_on_failure: bool = _opt(False, "when the engine core dies (crash, kill, "
                                           "OOM kill), fail its requests and start a new core "
                                           "instead of exiting non-zero")
    max_engine_restarts: int = _opt(3, "with --restart-engine-on-failure: restarts allowed "
                                    "before the server gives up and exits non-zero")


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvserve", version=__version__)
    app.state.engine = engine
    app.state.config = config
    _install_middleware(app, config)
    _install_error_handlers(app)
    _install_routes(app, engine, config)
    return app


# ---- middleware ----------------------------------------------------------------------------
def _install_middleware(app: FastAPI, config: ServerConfig) -> None:
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_request_body_bytes)


class GuardMiddleware:
    """API key and body-size checks as plain ASGI, so streaming and disconnect detection pass
    through untouched (Starlette's BaseHTTPMiddleware wraps `receive` and hides disconnects).

    The key is compared as SHA-256 digests with `hmac.compare_digest`: constant time, and the
    length of the key does not leak either. The body is read here, before any route runs, so a
    limit holds for chunked uploads without a Content-Length too; it is then replayed to the app.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = _digest(f"Bearer {api_key}".encode()) if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope.get("path") != "/health":
            if not hmac.compare_digest(_digest(headers.get(b"authorization", b"")),
                                       self.expected):
                response = error_response(401, "invalid or missing API key: send "
                                          "'Authorization: Bearer <key>'", code="invalid_api_key")
                return await response(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        body, complete = await self._read_body(receive)
        if body is None:
            return await self._too_large(scope, receive, send)
        if not complete:
            return  # the client left while sending its request
        return await self.app(scope, _replay(body, receive), send)

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
        response = error_response(413, f"request body over {self.max_body_bytes} bytes",
                                  code="request_too_large", headers={"Connection": "close"})
        return await response(scope, receive, send)


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
    async def on_http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}")


# ---- routes --------------------------------------------------------------------------------
def _install_routes(app: FastAPI, engine: AsyncEngine, config: ServerConfig) -> None:
    def model_name() -> str:
        info = engine.model_info()
        return config.served_model_name or (info.name if info else engine.config.model)

    def check_ready_and_model(requested: str | None) -> JSONResponse | None:
        if not engine.is_ready:
            return error_response(503, "the model is still loading" if engine.is_alive
                                  else "the engine is not running", code="not_ready")
        if requested and requested not in (model_name(), engine.config.model):
            return error_response(404, f"model {requested!r} does not exist; this server "
                                  f"serves {model_name()!r}", "model", "model_not_found")
        if engine.num_unfinished >= config.max_waiting_requests:
            return error_response(503, "too many requests in flight; retry later",
                                  code="overloaded", headers={"Retry-After": "1"})
        return None

    @app.get("/health")
    async def health():
        if engine.is_ready:
            return Response(status_code=200)
        reason = "loading" if engine.is_alive else "engine not running"
        return error_response(503, reason, code="not_ready")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        info = engine.model_info()
        max_len = info.max_model_len if info else None
        return {"object": "list", "data": [{
            "id": model_name(), "object": "model", "created": int(time.time()),
            "owned_by": "kvserve", "root": engine.config.model, "max_model_len": max_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_events_info")
    async def kv_events_endpoints():
        """Where this replica publishes its KV events, and its block size (kvserve router)."""
        info = kv_events_info(engine.config.kv_events_config, engine.config.block_size)
        model = engine.model_info()
        info["num_kv_blocks"] = model.num_kv_blocks if model else None
        return info

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        problem = check_ready_and_model(body.model)
        if problem:
            return problem
        inputs = engine.inputs
        if body.messages is not None:
            tokens = inputs.render_chat([m.as_template_message() for m in body.messages],
                                        body.add_generation_prompt)["prompt_token_ids"]
        elif body.prompt is not None:
            tokens = inputs.tokenizer.encode(body.prompt, body.add_special_tokens)
        else:
            raise InvalidRequestError("give 'prompt' or 'messages'", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": inputs.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        problem = check_ready_and_model(body.model)
        if problem:
            return problem
        return {"prompt": engine.detokenize(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        problem = check_ready_and_model(body.model)
        if problem:
            return problem
        body.check_unsupported()
        response_id = serving.new_id("cmpl")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        prompts = body.prompts()
        kv_params = body.kv_params()
        if kv_params is not None and len(prompts) != 1:
            raise InvalidRequestError("kv_transfer_params needs a single prompt", param="prompt")
        prepared = [_prepare(engine, f"{response_id}-{i}", p, params, body.priority,
                             kv_params) for i, p in enumerate(prompts)]
        echo = [p.prompt if p.prompt is not None else engine.detokenize(p.prompt_token_ids)
                for p in prepared] if body.echo else []
        job = serving.make_job("completion", response_id, body, model_name(), prepared, echo,
                               not config.disable_log_requests, body.logprobs or 0)
        return await _run(job, body, raw, engine)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        problem = check_ready_and_model(body.model)
        if problem:
            return problem
        num_top = body.requested_logprobs()
        params = body.sampling_params(body.requested_max_tokens(), num_top)
        prompt = engine.inputs.render_chat([m.as_template_message() for m in body.messages],
                                           body.add_generation_prompt,
                                           **(body.chat_template_kwargs or {}))
        response_id = serving.new_id("chatcmpl")
        prepared = [_prepare(engine, response_id, prompt, params, body.priority,
                             body.kv_params())]
        job = serving.make_job("chat", response_id, body, model_name(), prepared, [],
                               not config.disable_log_requests, num_top or 0)
        return await _run(job, body, raw, engine)


def _prepare(engine: AsyncEngine, *args):
    """`engine.prepare`, with an error in the processors' arguments named by the HTTP field
    that carried them (vllm_xargs)."""
    try:
        return engine.prepare(*args)
    except InvalidRequestError as exc:
        if exc.param != "extra_args":
            raise
        raise InvalidRequestError(str(exc).replace("extra_args", "vllm_xargs", 1),
                                  param="vllm_xargs") from exc


async def _run(job, body, raw: Request, engine: AsyncEngine):
    if job.log_requests:
        serving.logger.info("%s received: %d prompt(s), %d prompt tokens, n=%d, stream=%s",
                            job.response_id, len(job.prepared),
                            sum(len(p.prompt_token_ids) for p in job.prepared), job.n,
                            body.stream)
    if body.stream:
        return serving.sse_response(serving.stream_job(engine, job, body.include_usage))
    started = time.monotonic()
    try:
        outputs = await serving.collect(engine, job, raw)
    except serving.ClientDisconnected:
        serving.logger.info("%s aborted: client disconnected", job.response_id)
        return Response(status_code=499)
    serving.log_finish(job, outputs, started)
    if job.kind == "chat":
        return serving.json_response(serving.chat_response(job, outputs))
    return serving.json_response(serving.completion_response(job, outputs))


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


def run_server(engine_config, server_config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT. In-flight requests get `shutdown_timeout` seconds to finish;
    those still running then get a clean error (a 503 body, or an SSE error event and [DONE])
    before uvicorn closes their connections, and the process exits 0."""
    import uvicorn

    _GracefulServer = _graceful_server_class()
    engine = AsyncEngine(engine_config, server_config.served_model_name,
                         restart_on_failure=server_config.restart_engine_on_failure,
                         max_restarts=server_config.max_engine_restarts)
    app = build_app(engine, server_config)
    uv_config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                               log_level="info", access_log=not server_config.disable_log_requests,
                               timeout_graceful_shutdown=server_config.shutdown_timeout
                               + _SHUTDOWN_MARGIN_SECONDS)
    server = _GracefulServer(uv_config)
    exit_code = 0

    async def watch_engine():
        nonlocal exit_code
        while not server.should_exit:
            if engine.startup_error is not None:
                logger.error("engine failed to start: %s", engine.startup_error)
                exit_code = 1
                server.should_exit = True
            elif engine.fatal_error is not None:
                # its streams have their errors already; exit so an orchestrator restarts us
                logger.error("engine core died: %s; exiting", engine.fatal_error)
                exit_code = 1
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
