"""One engine replica as a Ray Serve deployment: an AsyncEngine and the plain server's OpenAI app.

Requests arrive as `OpenAIRequest`s through the ingress's DeploymentHandle and run through the
same FastAPI app `kvserve serve` uses (entrypoints/openai/server.py), in process (asgi.py); the
replica streams back the app's status and headers, the body chunks, and last its prefix-cache
counters (the ingress's /metrics adds them up for `kvserve bench`).

Each replica publishes its KV events on free ports of its node's address when KVSERVE_ZMQ_SECRET
guards them (else on loopback: only an ingress on its node can subscribe), so the router can
subscribe wherever it runs, and tells the router where, with its block size and pool size, in
`record_replica_metadata` (once, when ready) and again with its load in `record_routing_stats`
(every `request_routing_stats_period_s`). A dead engine fails `check_health`, and Serve
replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from kvserve.engine_config import EngineConfig
from kvserve.entrypoints.openai.server import ServerConfig, build_app
from kvserve.kv_events import kv_events_info, with_kv_events
from kvserve.ray_serve.asgi import call_app, http_scope
from kvserve.ray_serve.request import OpenAIRequest
from kvserve.ray_serve.slo_stats import SLOStats
from kvserve.zmq_security import SECRET_ENV, curve_keys

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvserve-replica"


class EngineReplica:
    """The deployment class (app.py wraps it with `serve.deployment`)."""

    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                       kv_events_host: str | None = None, slo_window_s: float = 10.0,
                       slo_quantile: float = 0.9):
        from ray import serve
        from ray.util import get_node_ip_address

        from kvserve.engine.async_engine import AsyncEngine

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = get_node_ip_address()
        self.config = with_kv_events(engine_config, kv_events_host or _events_host(self.node_ip))
        self.engine = AsyncEngine(self.config, server_config.served_model_name,
                                  restart_on_failure=server_config.restart_engine_on_failure,
                                  max_restarts=server_config.max_engine_restarts)
        self.app = build_app(self.engine, server_config)
        self.slo_stats = SLOStats(self.engine.metrics.registry, slo_window_s, slo_quantile)
        self.engine.start()
        # Serve routes to a replica once its constructor returns: not before warm-up
        await asyncio.to_thread(self.engine.ready.wait)
        error = self.engine.startup_error
        if error is not None:
            raise RuntimeError(f"the engine failed to start: {type(error).__name__}: {error}")
        logger.info("replica %s ready; KV events %s", self.replica_id, self.kv_events())

    # ---- requests ------------------------------------------------------------------------
    async def handle(self, request: OpenAIRequest) -> AsyncIterator:
        """("start", status, headers, replica id), then body chunks (bytes), then ("end",
        counters). Closed early by the caller: the app sees its client disconnect."""
        scope = http_scope(request.method, request.path, request.headers, request.body)
        async for message in call_app(self.app, scope, request.body):
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1"))
                           for k, v in message.get("headers", [])]
                yield ("start", message["status"], headers, self.replica_id)
            elif message.get("body"):
                yield message["body"]
        yield ("end", self.counters())

    # ---- what the router and the ingress learn -------------------------------------------
    def kv_events(self) -> dict:
        info = kv_events_info(self.config.kv_events_config, self.config.block_size)
        info["node_ip"] = self.node_ip  # a loopback endpoint is reachable from this node only
        model = self.engine.model_info()
        info["num_kv_blocks"] = model.num_kv_blocks if model else None
        return info

    def counters(self) -> dict:
        """The engine's cumulative prefix-cache counters (they survive core restarts), read
        one sample at a time: rendering all of /metrics costs ~4 ms, too much per request."""
        metrics = self.engine.metrics
        labels = {"model_name": metrics.model_name}
        values = {name: metrics.registry.get_sample_value(f"kvserve:{name}_total", labels)
                  for name in ("prefix_cache_queries", "prefix_cache_hits")}
        return {"replica": self.replica_id, "kv_events": self.kv_events(),
                **{name: value or 0.0 for name, value in values.items()}}

    def record_replica_metadata(self) -> dict:
        return {"kv_events": self.kv_events()}

    def record_routing_stats(self) -> dict:
        stats = self.engine.last_stats()
        return {"kv_events": self.kv_events(), "time": time.time(),
                "num_running": stats.num_running if stats else 0,
                "num_waiting": stats.num_waiting if stats else 0,
                "kv_blocks_used": stats.num_used_blocks if stats else 0,
                "kv_usage": stats.kv_usage if stats else 0.0}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For the SLO planner (planner.py), when autoscaling is on (Ray calls it then only):
        TTFT and ITL quantiles over the window, waiting and running requests, KV usage."""
        return self.slo_stats.stats(time.monotonic(), self.engine.last_stats())

    def check_health(self) -> None:
        if not self.engine.is_alive:
            error = self.engine.fatal_error or self.engine.startup_error
            raise RuntimeError(f"the engine is not running: {error}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(timeout=10.0)


def _events_host(node_ip: str) -> str:
    """The node's address when the shared secret guards the sockets (zmq_security.py), else
    loopback: an ingress on another node then routes this replica by load alone."""
    if curve_keys() is not None:
        return node_ip
    logger.warning("KV events on 127.0.0.1: set %s on every node so that an ingress on another "
                   "node can subscribe to them", SECRET_ENV)
    return "127.0.0.1"
