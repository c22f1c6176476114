"""The Ray Serve application: engine replicas behind one OpenAI ingress, placed by a request
router, and the two ways to run it.

- `kvserve serve --replicas N` (N >= 2; `run_replicas`): connects to the cluster RAY_ADDRESS
  names, else starts a local Ray instance, starts Ray Serve's HTTP proxy on --host/--port,
  deploys the app and serves until SIGINT/SIGTERM, then deletes it (shutting Serve and Ray down
  when it started them).
- `serve run kvserve.ray_serve.app:build_app model=... replicas=4` on a cluster (`build_app`),
  or a Serve config file naming the same function: every `kvserve serve` flag is an argument,
  `--` dropped and `-` or `_` alike.

The router is chosen by name (config.REQUEST_ROUTERS): ours run as KVAwareRequestRouter with a
policy; Ray's are given by their import paths. Every engine flag applies to each replica, and
each replica's torch threads follow its CPU reservation unless --num-threads says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import time

from kvserve.engine_config import EngineConfig
from kvserve.entrypoints.cli_args import (
    add_dataclass_args,
    add_engine_args,
    dataclass_from_args,
    engine_config_from_args,
)
from kvserve.entrypoints.openai.server import ServerConfig
from kvserve.ray_serve.config import RayServeConfig

logger = logging.getLogger(__name__)

APP_NAME = "kvserve"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
KV_AWARE_ROUTER = "kvserve.ray_serve.router:KVAwareRequestRouter"
RAY_ROUTERS = {
    "prefix-cache-affinity": "kvserve.ray_serve.ray_prefix:TextPrefixCacheAffinityRouter",
    "power-of-two-choices": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}
HEALTH_CHECK_PERIOD_S = 2.0  # a dead engine fails check_health; Serve then replaces it
DRAIN_POLL_S = 0.5  # how often a stopping replica checks its requests are done (Serve: 2 s)


def request_router_config(engine_config: EngineConfig, serve_config: RayServeConfig):
    from ray.serve.config import RequestRouterConfig

    name = serve_config.request_router
    if name in RAY_ROUTERS:
        router_class, kwargs = RAY_ROUTERS[name], {}
    else:
        router_class = KV_AWARE_ROUTER
        kwargs = {"model": engine_config.model, "policy": name,
                  "overlap_weight": serve_config.overlap_weight,
                  "stale_after": max(3.0, 3 * serve_config.request_routing_stats_period_s)}
    if serve_config.request_router_kwargs:
        extra = json.loads(serve_config.request_router_kwargs)
        if not isinstance(extra, dict):
            raise ValueError("--request-router-kwargs must be a JSON object")
        kwargs.update(extra)
    return RequestRouterConfig(
        request_router_class=router_class, request_router_kwargs=kwargs,
        request_routing_stats_period_s=serve_config.request_routing_stats_period_s)


def replica_cpus(serve_config: RayServeConfig) -> float:
    """The reservation asked, else 1, or an equal share of a cluster with fewer CPUs than
    replicas (so 2 replicas place on 2 cores beside the ingress, which reserves none)."""
    if serve_config.num_cpus_per_replica is not None:
        return serve_config.num_cpus_per_replica
    import ray

    total = ray.cluster_resources().get("CPU", 0.0) if ray.is_initialized() else 0.0
    if not total:
        return 1.0
    return min(1.0, total / serve_config.most_replicas)


def replica_count(serve_config: RayServeConfig) -> dict:
    """`serve.deployment`'s replica arguments: a fixed count, or the SLO planner's
    autoscaling config (autoscaling.py)."""
    if not serve_config.autoscaling:
        return {"num_replicas": serve_config.replicas}
    from kvserve.ray_serve.autoscaling import autoscaling_config

    return {"autoscaling_config": autoscaling_config(serve_config)}


def build_deployments(engine_config: EngineConfig, server_config: ServerConfig,
                      serve_config: RayServeConfig):
    """The bound application (ingress -> engine replicas), ready for `serve.run`."""
    from ray import serve

    from kvserve.ray_serve.ingress import OpenAIIngress
    from kvserve.ray_serve.replica import EngineReplica

    cpus = replica_cpus(serve_config)
    # Serve's access log is a line per call in each actor, shipped to the driver
    logging_config = {"enable_access_log": not server_config.disable_log_requests}
    if engine_config.num_threads is None:
        engine_config = dataclasses.replace(engine_config, num_threads=max(1, int(cpus)))
    replica = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, **replica_count(serve_config),
        max_ongoing_requests=serve_config.max_ongoing_requests,
        ray_actor_options={"num_cpus": cpus},
        request_router_config=request_router_config(engine_config, serve_config),
        health_check_period_s=HEALTH_CHECK_PERIOD_S, logging_config=logging_config,
        # a replica scaled down (or replaced) stops taking requests, then finishes its streams
        graceful_shutdown_timeout_s=server_config.shutdown_timeout,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress), name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=serve_config.most_replicas * serve_config.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0}, logging_config=logging_config,
        graceful_shutdown_timeout_s=server_config.shutdown_timeout)
    slo_stats = {"slo_window_s": serve_config.autoscale_window_s,
                 "slo_quantile": serve_config.slo_quantile} if serve_config.autoscaling else {}
    return ingress.bind(replica.bind(engine_config, server_config, serve_config.kv_events_host,
                                     **slo_stats),
                        serve_config.request_router, server_config.api_key,
                        server_config.max_request_body_bytes,
                        engine_config.model if serve_config.measure_placement else None)


# ---- serve run kvserve.ray_serve.app:build_app ----------------------------------------------
def app_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve.ray_serve.app:build_app")
    add_engine_args(parser)
    add_dataclass_args(parser, ServerConfig, "server")
    add_dataclass_args(parser, RayServeConfig, "replicas (Ray Serve)")
    return parser


def args_to_argv(args: dict) -> list[str]:
    """{"model": "x", "enable_prefix_caching": "false"} -> ["--model", "x",
    "--no-enable-prefix-caching"]: `serve run` passes key=value strings, a config file typed
    values."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.lstrip("-").replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            truthy = value if isinstance(value, bool) else str(value).lower() == "true"
            argv.append(flag if truthy else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):  # a repeatable flag: --logits-processors
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def build_app(args: dict):
    """Ray Serve's application builder: `serve run kvserve.ray_serve.app:build_app
    model=/models/x replicas=4 request_router=kv-aware`."""
    namespace = app_parser().parse_args(args_to_argv(args))
    return build_deployments(engine_config_from_args(namespace),
                             dataclass_from_args(ServerConfig, namespace),
                             dataclass_from_args(RayServeConfig, namespace))


# ---- kvserve serve --replicas N -------------------------------------------------------------
def _start_ray() -> bool:
    """Connect to RAY_ADDRESS's cluster, else start a local instance (no dashboard); True when
    the instance is ours to stop."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address or "local", include_dashboard=False if address is None else None,
             logging_level=logging.ERROR)
    logger.info("%s Ray (%s CPUs)", f"connected to the cluster at {address}:" if address
                else "started a local", ray.cluster_resources().get("CPU"))
    return address is None


def run_replicas(engine_config: EngineConfig, server_config: ServerConfig,
                 serve_config: RayServeConfig) -> int:
    """Deploy on Ray Serve and serve until SIGINT/SIGTERM; 1 if the app failed to start."""
    import ray
    from ray import serve

    owns_ray = _start_ray()
    # after ray.init, whose own SIGTERM handler kills Ray at once and exits 1; a list, not an
    # Event: a second signal landing inside Event.set would deadlock on the Event's lock
    signals: list[int] = []
    serving = False

    def on_signal(number: int, _) -> None:
        signals.append(number)
        if not serving:  # still deploying (replicas may be failing to start): give up now
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    exit_code = 0
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        app = build_deployments(engine_config, server_config, serve_config)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        serving = True
        logger.info("serving %s replicas of %s on http://%s:%d (request router: %s)",
                    "%d-%d (SLO planner)" % serve_config.bounds if serve_config.autoscaling
                    else serve_config.replicas, engine_config.model, server_config.host,
                    server_config.port, serve_config.request_router)
        while not signals:
            time.sleep(0.2)
        logger.info("%s: shutting down", signal.Signals(signals[0]).name)
    except KeyboardInterrupt:
        logger.warning("interrupted while deploying")
        exit_code = 1
    except Exception as exc:  # noqa: BLE001 - the app failed to deploy: say why, exit non-zero
        logger.error("the Ray Serve app failed: %s: %s", type(exc).__name__, exc)
        exit_code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            if owns_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return exit_code
