"""The HTTP front of the Ray Serve app: OpenAI routes, each call sent to an engine replica
through a DeploymentHandle, whose request router (router.py, or one of Ray's) picks the replica.

A request body goes to the replica as received (the replica's app validates it, so errors come
back as the plain server's OpenAI bodies), with the Authorization, content type, accept, request
id and user agent headers. Like `kvserve router`: a replica that dies before answering (for a
stream: before its first chunk) is counted and the request goes once more, to whichever replica
the router picks then; after the first chunk a failure ends the stream with an SSE error event
and [DONE]. Answers carry `X-Kvserve-Replica`. A client that goes away cancels the call, and
the replica aborts its engine requests.

For `kvserve bench`, /metrics sums the replicas' prefix-cache counters (each answer ends with
its replica's) and /router/state lists the replicas as URLs whose /metrics are theirs; with
--measure-placement it also counts how good each placement was (placement.py).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from kvserve import __version__
from kvserve.entrypoints.openai.errors import error_body, error_response
from kvserve.entrypoints.openai.server import GuardMiddleware
from kvserve.ray_serve import registry
from kvserve.ray_serve.replica import REPLICA_HEADER
from kvserve.ray_serve.request import OpenAIRequest
from kvserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = (b"authorization", b"content-type", b"accept", b"x-request-id",
                      b"user-agent")
_PASSED_BACK_HEADERS = ("content-type", "retry-after")
HEALTH_TIMEOUT_SECONDS = 5.0


def _replica_gone_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return RayActorError, ActorUnavailableError


class PrefixCounters:
    """A Prometheus collector of replicas' prefix-cache counters, under the engine's names."""

    def __init__(self, counters: dict[str, dict]):
        self.counters = counters

    def collect(self):
        for name, help_text in (("prefix_cache_queries", "Prompt tokens looked up"),
                                ("prefix_cache_hits", "Prompt tokens found in the prefix "
                                 "cache")):
            family = CounterMetricFamily(f"kvserve:{name}", f"{help_text}, per replica (as "
                                         f"of its last answer)", labels=["replica"])
            for replica, values in self.counters.items():
                family.add_metric([replica], values.get(name, 0.0))
            yield family


class OpenAIIngress:
    """The ingress deployment class (app.py wraps it with serve.ingress and serve.deployment)."""

    def __init__(self, engine, request_router: str, api_key: str | None = None,
                 max_request_body_bytes: int = 16 * 2**20,
                 measure_placement_model: str | None = None):
        self.engine = engine  # DeploymentHandle of the EngineReplica deployment
        self.request_router = request_router
        self.api_key = api_key
        self.max_request_body_bytes = max_request_body_bytes
        self.counters: dict[str, dict] = {}  # replica id -> its counters at its last answer
        self.metrics = RouterMetrics()
        self.metrics.registry.register(PrefixCounters(self.counters))
        self.gone = _replica_gone_errors()
        self.placement = None
        if measure_placement_model:
            from kvserve.ray_serve.placement import PlacementMeter

            self.placement = PlacementMeter(measure_placement_model, self.metrics)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    # ---- forwarding ----------------------------------------------------------------------
    async def forward(self, raw: Request, path: str, method: str = "POST") -> Response:
        body = await raw.body() if method == "POST" else b""
        headers = [(k, v) for k, v in raw.headers.raw if k.lower() in _FORWARDED_HEADERS]
        request = OpenAIRequest(path, body, headers, method)
        held = await self.placement.held(path, request.payload) \
            if self.placement is not None and method == "POST" else {}
        last_error: BaseException | None = None
        for attempt in range(2):
            chunks = self.engine.options(stream=True).handle.remote(request)
            try:
                start = await chunks.__anext__()
            except self.gone as exc:
                chunks.cancel()
                last_error = exc
                self.metrics.failures.labels("unknown").inc()
                if attempt == 0:
                    self.metrics.retries.inc()
                logger.warning("%s: the replica failed before answering (%s)%s", path,
                               type(exc).__name__, "; retrying" if attempt == 0 else "")
                continue
            except BaseException:
                chunks.cancel()
                raise
            _, status, replica_headers, replica = start
            self.metrics.requests.labels(replica).inc()
            if self.placement is not None:
                self.placement.record(held, replica)
            headers = {k: v for k, v in replica_headers if k.lower() in _PASSED_BACK_HEADERS}
            headers[REPLICA_HEADER] = replica
            if request.stream and status == 200:
                headers["cache-control"] = "no-cache"
                return StreamingResponse(self._relay(chunks, replica), status_code=status,
                                         headers=headers)
            return await self._answer(chunks, status, headers, replica)
        return error_response(502, f"the replica failed before answering "
                              f"({type(last_error).__name__})", code="replica_unavailable")

    def _finished(self, replica: str, counters: dict) -> None:
        self.counters[replica] = counters
        if self.placement is not None:
            self.placement.learn(replica, counters.get("kv_events"))

    async def _relay(self, chunks, replica: str):
        finished = False
        try:
            async for item in chunks:
                if isinstance(item, bytes):
                    yield item
                elif item[0] == "end":
                    self._finished(replica, item[1])
            finished = True
        except self.gone as exc:  # the replica died mid-stream
            self.metrics.failures.labels(replica).inc()
            body = error_body(502, f"the replica failed mid-stream ({type(exc).__name__})",
                              code="replica_unavailable")
            yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
            finished = True
        finally:
            if not finished:  # the client went away: the replica aborts
                chunks.cancel()

    async def _answer(self, chunks, status: int, headers: dict, replica: str) -> Response:
        parts: list[bytes] = []
        finished = False
        try:
            async for item in chunks:
                if isinstance(item, bytes):
                    parts.append(item)
                elif item[0] == "end":
                    self._finished(replica, item[1])
            finished = True
        except self.gone as exc:
            self.metrics.failures.labels(replica).inc()
            return error_response(502, f"the replica failed while answering "
                                  f"({type(exc).__name__})", code="replica_unavailable")
        finally:
            if not finished:
                chunks.cancel()
        return Response(b"".join(parts), status_code=status, headers=headers)

    # ---- introspection -------------------------------------------------------------------
    def router_view(self) -> dict:
        """The KV-aware router's view of the replicas, when it runs in this process."""
        router = registry.ROUTERS.get(registry.key(self.engine.app_name,
                                                    self.engine.deployment_name))
        return router.state() if router is not None else {}

    def state(self, base_url: str) -> dict:
        view = self.router_view()
        replicas = {}
        for name in sorted(set(view) | set(self.counters)):
            counters = self.counters.get(name, {})
            replicas[f"{base_url}/replicas/{name}"] = {
                "replica_id": name, "current": name in view if view else None,
                "prefix_cache_queries": counters.get("prefix_cache_queries", 0.0),
                "prefix_cache_hits": counters.get("prefix_cache_hits", 0.0),
                **view.get(name, {})}
        return {"policy": self.request_router, "replicas": replicas}

    def replica_metrics(self, name: str) -> bytes:
        collectors = CollectorRegistry()
        collectors.register(PrefixCounters({name: self.counters.get(name, {})}))
        return generate_latest(collectors)


def build_ingress_app(ingress: OpenAIIngress) -> FastAPI:
    app = FastAPI(title="kvserve (Ray Serve)", version=__version__)
    app.add_middleware(GuardMiddleware, api_key=ingress.api_key,
                       max_body_bytes=ingress.max_request_body_bytes)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        app.add_api_route(path, _poster(ingress, path), methods=["POST"])

    @app.get("/v1/models")
    async def models(raw: Request):
        return await ingress.forward(raw, "/v1/models", "GET")

    @app.get("/health")
    async def health(raw: Request):
        """200 when a replica answers its own /health; 503 when none does in time (Ray
        Serve's router waits for a replica while there is none)."""
        try:
            return await asyncio.wait_for(ingress.forward(raw, "/health", "GET"),
                                          HEALTH_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            return error_response(503, f"no engine replica answered within "
                                  f"{HEALTH_TIMEOUT_SECONDS:.0f} s", code="no_replica")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(ingress.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def state(raw: Request):
        return JSONResponse(ingress.state(str(raw.base_url).rstrip("/")))

    @app.get("/replicas/{name}/metrics")
    async def replica_metrics(name: str):
        return Response(ingress.replica_metrics(name), media_type=CONTENT_TYPE_LATEST)

    return app


def _poster(ingress: OpenAIIngress, path: str):
    async def post(raw: Request):
        return await ingress.forward(raw, path)

    post.__name__ = "post_" + path.strip("/").replace("/", "_")
    return post
