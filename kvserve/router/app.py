"""The router's HTTP side: OpenAI routes forwarded to the replica the policy ranks first.

In disaggregated mode (--prefill and --decode URLs instead of --replica) the replicas are
decode servers, and each prompt first goes to a prefill server (router/disagg.py).

A request's body is forwarded as it came (the router tokenizes it only to score replicas). A
replica that fails before answering (refused, reset, or a stream that ends before its first
chunk) is marked down and the request goes once to the next-ranked replica; after the first
byte has reached the client, a failure ends the stream with an SSE error event and [DONE].
Replica answers, errors included, pass through with their status and body.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.entrypoints.openai.disconnect import until_disconnected
from kvserve.entrypoints.openai.errors import error_body, error_response
from kvserve.entrypoints.openai.webui import install_webui
from kvserve.kv_events import ReplayClient
from kvserve.model_source import DEFAULT_MODEL
from kvserve.options import option as _opt
from kvserve.protocol.block_hash import block_hashes
from kvserve.router.approximate import ApproximateIndex
from kvserve.router.disagg import PrefillStage
from kvserve.router.index import KVIndex, parse_tier_weights
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import POLICIES, Candidate, make_policy
from kvserve.router.prompts import CHAT_PATH, COMPLETIONS_PATH, PromptTokenizer, cache_salt_of
from kvserve.router.replicas import Replica, ReplicaMonitor
from kvserve.router.subscriber import EventSubscriber, reachable_endpoint

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
# request headers a replica should see; the rest (host, length, hop-by-hop) are httpx's
_FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "user-agent")


@dataclass(frozen=True)
class RouterConfig:
    host: str = _opt("127.0.0.1", "address to bind")
    port: int = _opt(8080, "port to listen on")
    policy: str = _opt("kv-aware", "kv-aware (cached prefix blocks against load, Dynamo's "
                       "cost), round-robin or least-loaded", choices=list(POLICIES))
    model: str = _opt(DEFAULT_MODEL, "the replicas' model reference (bundled name, .gguf or "
                      "HF directory): its tokenizer and chat template turn prompts into the "
                      "block hashes the replicas publish")
    overlap_weight: float = _opt(1.0, "kv-aware: weight of the uncached prompt blocks against "
                                 "the blocks in use (>1 favours TTFT, <1 spreads load)")
    tier_weights: str = _opt("CPU=0.8,DISK=0.6", "kv-aware: what a prompt block held in a "
                             "replica's offload tier counts for against one in its pool, by "
                             "the tier's event medium (MEDIUM=WEIGHT,...; a load is dearer "
                             "than a hit, cheaper than a recompute)")
    stale_after: float = _opt(3.0, "seconds without a KV event batch (replicas send one each "
                              "second) after which a replica counts as holding nothing")
    health_interval: float = _opt(1.0, "seconds between /health (and /metrics) checks")
    connect_timeout: float = _opt(3.0, "seconds to connect to a replica")
    request_timeout: float = _opt(600.0, "seconds a replica may go without sending anything")
    replica_api_key: str | None = _opt(None, "API key for the router's own calls to the "
                                       "replicas (/health, /metrics, /kv_events_info); "
                                       "clients' Authorization headers are forwarded as sent")
    measure_placement: bool = _opt(False, "benchmarks: before forwarding, ask every replica how "
                                   "many prefix blocks it holds for the prompt (its KV events "
                                   "ROUTER socket) and count whether the chosen one held the "
                                   "most (/metrics kvserve_router:placement_*); costs a round "
                                   "trip per replica per request")
    max_local_prefill_length: int = _opt(0, "disaggregated mode: a prompt whose part not "
                                         "cached on the chosen decode server is at most this "
                                         "many tokens is prefilled there, without a prefill "
                                         "server (Dynamo's conditional disaggregation; 0: "
                                         "only prompts it holds whole)")
    seed: int | None = _opt(None, "seed of the tie-breaking random choice")
    disable_log_requests: bool = _opt(False, "do not log each routing decision")
    webui: bool = _opt(True, "serve the web page (chat through the router, its own metrics) "
                       "at /; --no-webui: / is a 404")


class Router:
    def __init__(self, config: RouterConfig, replica_urls: list[str],
                 prompts: PromptTokenizer | None = None, prefill_urls: list[str] = (),
                 decode_urls: list[str] = ()):
        roles = replica_roles(replica_urls, prefill_urls, decode_urls)
        self.config = config
        self.replicas = {url: Replica(url, role) for url, role in roles.items()}
        self.disaggregated = bool(prefill_urls)
        self.client_role = "decode" if self.disaggregated else "both"  # who answers clients
        self.prefill_stage = PrefillStage(self)
        self.prompts = prompts
        self.index = KVIndex()
        self.approximate = ApproximateIndex(self.index)
        self.subscriber = EventSubscriber(self.index)
        # one per role: round-robin takes each pool's replicas in turn
        self.tier_weights = parse_tier_weights(config.tier_weights)
        self.policies = {role: make_policy(config.policy, config.overlap_weight, config.seed)
                         for role in ("both", "prefill", "decode")}
        self.policy = self.policies[self.client_role]
        self.metrics = RouterMetrics()
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        own_headers = {"Authorization": f"Bearer {config.replica_api_key}"} \
            if config.replica_api_key else {}
        self.monitor = ReplicaMonitor(list(self.replicas.values()), self.http, self.subscriber,
                                      config.health_interval, own_headers, self.approximate)
        self._serial = itertools.count()
        self._monitor_task: asyncio.Task | None = None
        self._probe_context = zmq.Context() if config.measure_placement else None
        self._probes: dict[str, tuple[threading.Lock, ReplayClient]] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        await self.monitor.check_all()
        self._monitor_task = asyncio.ensure_future(self.monitor.run())

    async def close(self) -> None:
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            await asyncio.gather(self._monitor_task, return_exceptions=True)
        await self.http.aclose()
        self.subscriber.close()
        for lock, client in self._probes.values():
            with lock:
                client.close()
        if self._probe_context is not None:
            self._probe_context.term()

    # ---- scoring -------------------------------------------------------------------------
    def block_size(self, role: str) -> int:
        return next((r.block_size for r in self.replicas.values()
                     if r.role == role and r.healthy and r.block_size), DEFAULT_BLOCK_SIZE)

    def rank(self, token_ids: list[int] | None, role: str | None = None,
             cache_salt: str | None = None) -> tuple[list[Candidate], int]:
        """Healthy replicas of `role` (default: those answering clients), best first, and the
        prompt's full blocks (hashed under the request's `cache_salt`, as the replicas do)."""
        now = time.monotonic()
        role = role or self.client_role
        healthy = [r for r in self.replicas.values() if r.healthy and r.role == role]
        block_size = self.block_size(role)
        prompt_blocks = len(token_ids) // block_size if token_ids else 0
        overlaps: dict[str, int] = {}
        if token_ids and self.policy.uses_overlap:
            by_size: dict[int, list[str]] = {}
            for replica in healthy:
                if replica.block_size and (self.approximate.covers(replica.url)
                                           or self.subscriber.fresh(replica.url,
                                                                    self.config.stale_after)):
                    by_size.setdefault(replica.block_size, []).append(replica.url)
            for size, names in by_size.items():
                overlaps.update(self.index.weighted_overlaps(
                    block_hashes(token_ids, size, cache_salt=cache_salt), names,
                    self.tier_weights))
        candidates = [Candidate(r.url, overlaps.get(r.url, 0),
                                r.active_blocks(now, self.config.stale_after)) for r in healthy]
        return self.policies[role].rank(candidates, prompt_blocks), prompt_blocks

    # ---- forwarding ----------------------------------------------------------------------
    async def forward(self, raw: Request, path: str) -> Response:
        body = await raw.body()
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        streaming = isinstance(payload, dict) and payload.get("stream") is True
        token_ids = self.prompts.token_ids(path, payload) if self.prompts else None
        salt = cache_salt_of(payload)
        ranked, prompt_blocks = self.rank(token_ids, cache_salt=salt)
        if not ranked:
            self.metrics.unroutable.inc()
            return error_response(503, "no healthy replica behind the router",
                                  code="no_replica", headers={"Retry-After": "1"})
        if self.config.measure_placement and token_ids:
            await self._measure_placement(ranked[0], token_ids, salt)
        self.metrics.prompt_blocks.inc(prompt_blocks)
        self.metrics.predicted_blocks.inc(ranked[0].overlap_blocks)
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        extra_headers: dict = {}
        if self.disaggregated:
            prefilled = await self.prefill_stage.run(raw, path, payload, token_ids, headers,
                                                     ranked[0], self.block_size("decode"))
            if prefilled.response is not None:
                return prefilled.response
            body = prefilled.body or body
            extra_headers = prefilled.headers
        load = prompt_blocks + 1  # its prompt and the block it decodes into
        last_error: BaseException | None = None
        for attempt, candidate in enumerate(ranked[:2]):
            replica = self.replicas[candidate.name]
            serial = next(self._serial)
            replica.inflight[serial] = load
            try:
                upstream, chunks, first = await self._open(replica, path, body, headers,
                                                           streaming)
            except httpx.HTTPError as exc:
                replica.inflight.pop(serial, None)
                last_error = exc
                self.metrics.failures.labels(replica.url).inc()
                self.monitor.mark_down(replica, f"{type(exc).__name__}: {exc}")
                if attempt == 0 and len(ranked) > 1:
                    self.metrics.retries.inc()
                continue
            self.metrics.requests.labels(replica.url).inc()
            if token_ids and upstream.status_code == 200:
                self._guess_cached(replica, token_ids, salt)
            if not self.config.disable_log_requests:
                logger.info("%s -> %s (%d/%d prompt blocks cached by the index, %.0f blocks "
                            "active, attempt %d)", path, replica.url, candidate.overlap_blocks,
                            prompt_blocks, candidate.active_blocks, attempt + 1)
            if streaming and upstream.status_code == 200:
                return self._relay(replica, serial, upstream, chunks, first, extra_headers)
            return await self._answer(replica, serial, upstream, raw, extra_headers)
        return error_response(502, f"the replica failed before answering "
                              f"({type(last_error).__name__}: {last_error})",
                              code="replica_unavailable")

    def _guess_cached(self, replica: Replica, token_ids: list[int], salt: str | None) -> None:
        """A replica without events: its cache now holds this prompt, as far as the router
        can tell."""
        if self.approximate.covers(replica.url) and replica.block_size:
            self.approximate.routed(replica.url, block_hashes(token_ids, replica.block_size,
                                                              cache_salt=salt))

    async def _open(self, replica: Replica, path: str, body: bytes, headers: dict,
                    streaming: bool):
        """Send the request; for a stream, also wait for its first chunk (so a replica dying
        during the prompt's prefill is still a failure before answering)."""
        request = self.http.build_request("POST", replica.url + path, content=body,
                                          headers=headers)
        upstream = await self.http.send(request, stream=True)
        chunks, first = None, b""
        if streaming and upstream.status_code == 200:
            chunks = upstream.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except BaseException:
                await upstream.aclose()
                raise
        return upstream, chunks, first

    def _relay(self, replica: Replica, serial: int, upstream: httpx.Response, chunks,
               first: bytes, extra_headers: dict) -> StreamingResponse:
        async def relay():
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:  # the replica went away mid-stream
                self.metrics.failures.labels(replica.url).inc()
                self.monitor.mark_down(replica, f"{type(exc).__name__}: {exc}")
                body = error_body(502, f"the replica failed mid-stream ({type(exc).__name__})",
                                  code="replica_unavailable")
                yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
            finally:
                replica.inflight.pop(serial, None)
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type",
                                                                 "text/event-stream"),
                                 headers={"Cache-Control": "no-cache",
                                          "X-Kvserve-Replica": replica.url, **extra_headers})

    @staticmethod
    async def until_disconnected(raw: Request, awaitable):
        """The awaitable's result, or None (it cancelled) once our client has gone away: the
        replica's request is dropped, so it aborts."""
        return await until_disconnected(raw, awaitable)

    async def _answer(self, replica: Replica, serial: int, upstream: httpx.Response,
                      raw: Request, extra_headers: dict) -> Response:
        """A whole answer, passed through (499 when our client went away meanwhile)."""
        try:
            content = await self.until_disconnected(raw, upstream.aread())
            if content is None:
                return Response(status_code=499)
        except httpx.HTTPError as exc:
            self.metrics.failures.labels(replica.url).inc()
            self.monitor.mark_down(replica, f"{type(exc).__name__}: {exc}")
            return error_response(502, f"the replica failed while answering "
                                  f"({type(exc).__name__})", code="replica_unavailable")
        finally:
            replica.inflight.pop(serial, None)
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"),
                        headers={"X-Kvserve-Replica": replica.url, **extra_headers})

    async def get_from_replica(self, path: str, raw: Request) -> Response:
        """GET routes (/v1/models): the first healthy replica answering clients that answers."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        for replica in self.replicas.values():
            if not replica.healthy or replica.role != self.client_role:
                continue
            try:
                response = await self.http.get(replica.url + path, headers=headers)
            except httpx.HTTPError as exc:
                self.monitor.mark_down(replica, f"{type(exc).__name__}: {exc}")
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        return error_response(503, "no healthy replica behind the router", code="no_replica")

    # ---- placement accuracy (benchmarks) -------------------------------------------------
    async def _measure_placement(self, chosen: Candidate, token_ids: list[int],
                                 cache_salt: str | None = None) -> None:
        role = self.replicas[chosen.name].role
        replicas = [r for r in self.replicas.values() if r.healthy and r.role == role
                    and (r.events_info or {}).get("replay_endpoint")]
        held = await asyncio.gather(*(asyncio.to_thread(self._probe, r, token_ids, cache_salt)
                                      for r in replicas))
        actual = {r.url: n for r, n in zip(replicas, held) if n is not None}
        if chosen.name not in actual:
            return
        best = max(actual.values())
        self.metrics.placements.inc()
        self.metrics.placements_best.inc(actual[chosen.name] == best)
        self.metrics.chosen_blocks.inc(actual[chosen.name])
        self.metrics.best_blocks.inc(best)
        self.metrics.index_matches.inc(actual[chosen.name] == chosen.overlap_blocks)
        logger.debug("placement: %s holds %d prefix blocks (index said %d), best %d: %s",
                     chosen.name, actual[chosen.name], chosen.overlap_blocks, best, actual)

    def _probe(self, replica: Replica, token_ids: list[int],
               cache_salt: str | None = None) -> int | None:
        endpoint = reachable_endpoint(replica.events_info.get("replay_endpoint"), replica.url)
        lock, client = self._probes.get(replica.url, (None, None))
        if client is None or client.endpoint != endpoint:
            lock, client = threading.Lock(), ReplayClient(self._probe_context, endpoint, 1.0)
            self._probes[replica.url] = (lock, client)
        with lock:
            return client.probe(token_ids, cache_salt)

    # ---- introspection -------------------------------------------------------------------
    def state(self) -> dict:
        now = time.monotonic()
        replicas = {}
        for replica in self.replicas.values():
            sync = self.subscriber.sync(replica.url)
            replicas[replica.url] = {
                "role": replica.role,
                "healthy": replica.healthy,
                "kv_events": bool((replica.events_info or {}).get("enabled")),
                "approximate_index": self.approximate.covers(replica.url),
                "synced": bool(sync and sync.synced),
                "fresh": self.subscriber.fresh(replica.url, self.config.stale_after),
                "engine_instance_id": sync.instance_id if sync else None,
                "last_seq": sync.last_seq if sync else None,
                "resyncs": sync.num_resyncs if sync else 0,
                "replays": sync.num_replays if sync else 0,
                "restarts_seen": sync.num_restarts if sync else 0,
                "indexed_blocks": self.index.num_blocks(replica.url),
                "inflight_requests": len(replica.inflight),
                "active_blocks": replica.active_blocks(now, self.config.stale_after),
                "prefix_cache_queries": replica.prefix_queries,
                "prefix_cache_hits": replica.prefix_hits,
            }
        return {"policy": self.policy.name, "disaggregated": self.disaggregated,
                "replicas": replicas}

    def render_metrics(self) -> bytes:
        now = time.monotonic()
        for replica in self.replicas.values():
            self.metrics.healthy.labels(replica.url).set(1 if replica.healthy else 0)
            self.metrics.indexed_blocks.labels(replica.url).set(self.index.num_blocks(replica.url))
            self.metrics.active_blocks.labels(replica.url).set(
                replica.active_blocks(now, self.config.stale_after))
        return self.metrics.render()


def build_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    @app.post(COMPLETIONS_PATH)
    async def completions(raw: Request):
        return await router.forward(raw, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat_completions(raw: Request):
        return await router.forward(raw, CHAT_PATH)

    @app.get("/v1/models")
    async def models(raw: Request):
        return await router.get_from_replica("/v1/models", raw)

    @app.get("/health")
    async def health():
        """200 while some replica can answer clients (in disaggregated mode a decode server:
        without prefill servers it prefills itself)."""
        healthy = [r.url for r in router.replicas.values() if r.healthy]
        if any(router.replicas[url].role == router.client_role for url in healthy):
            return JSONResponse({"healthy_replicas": healthy})
        return error_response(503, "no healthy replica", code="no_replica")

    @app.get("/metrics")
    async def metrics():
        return Response(router.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def state():
        return router.state()

    if router.config.webui:
        install_webui(app)
    return app


def replica_roles(replica_urls, prefill_urls, decode_urls) -> dict[str, str]:
    """URL -> role; aggregated (--replica) or disaggregated (--prefill and --decode), not both."""
    if bool(prefill_urls) != bool(decode_urls):
        raise ValueError("disaggregated mode needs both --prefill and --decode URLs")
    if prefill_urls and replica_urls:
        raise ValueError("give either --replica URLs (aggregated) or --prefill and --decode "
                         "URLs (disaggregated), not both")
    if not replica_urls and not prefill_urls:
        raise ValueError("the router needs at least one --replica URL (or --prefill and "
                         "--decode URLs)")
    roles: dict[str, str] = {}
    for urls, role in ((replica_urls, "both"), (prefill_urls, "prefill"),
                       (decode_urls, "decode")):
        for url in urls:
            url = url.rstrip("/")
            if roles.setdefault(url, role) != role:
                raise ValueError(f"{url} is given as both a prefill and a decode server")
    return roles


def run_router(config: RouterConfig, replica_urls: list[str], prefill_urls: list[str] = (),
               decode_urls: list[str] = ()) -> int:
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per polled request
    prompts = PromptTokenizer.load(config.model)
    router = Router(config, replica_urls, prompts, prefill_urls, decode_urls)
    logger.info("routing %s over %d replicas: %s", config.policy, len(router.replicas),
                ", ".join(f"{url} ({r.role})" for url, r in router.replicas.items()))
    uvicorn.run(build_router_app(router), host=config.host, port=config.port,
                log_level="info", access_log=False)
    return 0
