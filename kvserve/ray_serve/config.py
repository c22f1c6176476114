"""`kvserve serve --replicas N` options: how many engine replicas Ray Serve runs and how it picks
one per request. Kept free of Ray imports, so the CLI can list these flags without Ray."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.options import option as _opt

# ours (kvserve.router.policy, inside KVAwareRequestRouter), then Ray Serve's own routers
REQUEST_ROUTERS = ("kv-aware", "round-robin", "least-loaded", "prefix-cache-affinity",
                   "power-of-two-choices")


@dataclass(frozen=True)
class RayServeConfig:
    replicas: int = _opt(1, "engine replicas; 2 or more run as Ray Serve deployments on the "
                         "cluster RAY_ADDRESS names, else on a local Ray instance (needs "
                         "kvserve[ray]), behind one OpenAI ingress on --host/--port")
    request_router: str = _opt(
        "kv-aware", "with --replicas >= 2, Ray Serve's RequestRouter: kv-aware (the prompt's "
        "blocks each replica holds, from its KV events, against its load), round-robin, "
        "least-loaded, prefix-cache-affinity (Ray Serve LLM's PrefixCacheAffinityRouter: a "
        "character prefix tree of past prompts) or power-of-two-choices (Ray Serve's default)",
        choices=list(REQUEST_ROUTERS))
    request_router_kwargs: str | None = _opt(
        None, "JSON object of extra request_router_kwargs for the chosen router, e.g. "
        "{\"imbalanced_threshold\": 20} for prefix-cache-affinity (Ray's example; its default "
        "is infinity: never balance load) or {\"stale_after\": 5} for ours")
    overlap_weight: float = _opt(1.0, "kv-aware: weight of the uncached prompt blocks against "
                                 "the blocks in use (>1 favours TTFT, <1 spreads load)")
    num_cpus_per_replica: float | None = _opt(
        None, "Ray CPUs each replica reserves (ray_actor_options num_cpus; fractions allowed) "
        "and, without --num-threads, its torch threads (at least 1); default: 1, or an equal "
        "share of the cluster's CPUs when it has fewer than --replicas")
    max_ongoing_requests: int = _opt(256, "Ray Serve's max_ongoing_requests per replica: "
                                     "requests beyond it wait in the ingress's router")
    request_routing_stats_period_s: float = _opt(
        1.0, "seconds between the replicas' routing stats (KV blocks in use, running and "
        "waiting requests) reaching the router")
    measure_placement: bool = _opt(
        False, "benchmarks: before each request the ingress asks every replica how many of the "
        "prompt's leading blocks it caches and counts whether the router chose one holding the "
        "most (/metrics kvserve_router:placement_*), whichever router runs; costs a round trip "
        "per replica per request")
    kv_events_host: str | None = _opt(
        None, "address each replica binds its KV event sockets to, on free ports (default: "
        "its node's IP as Ray reports it, so a router on another node can subscribe; the "
        "events carry prompt token ids)")
