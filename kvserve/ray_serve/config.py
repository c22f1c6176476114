"""`kvserve serve --replicas N` options: how many engine replicas Ray Serve runs and how it picks
one per request. Kept free of Ray imports, so the CLI can list these flags without Ray."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import KVServeError
from kvserve.options import option as _opt

# ours (kvserve.router.policy, inside KVAwareRequestRouter), then Ray Serve's own routers
REQUEST_ROUTERS = ("kv-aware", "round-robin", "least-loaded", "prefix-cache-affinity",
                   "power-of-two-choices")


class AutoscalingConfigError(KVServeError, ValueError):
    """Autoscaling flags that contradict each other (the CLI prints it, exit 2)."""


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
    # ---- the SLO planner (planner.py): Ray Serve autoscaling of the engine replicas ------
    autoscale: bool = _opt(
        False, "scale the engine replicas between --min-replicas and --max-replicas with the "
        "SLO planner (a Ray Serve autoscaling policy: TTFT/ITL quantiles against --slo-*-ms, "
        "waiting requests, KV usage); implied by --max-replicas above --min-replicas; "
        "--replicas is then the initial count")
    min_replicas: int = _opt(1, "with autoscaling: Ray Serve's min_replicas (at least 1)")
    max_replicas: int | None = _opt(
        None, "with autoscaling: Ray Serve's max_replicas (default: --replicas, at least 2)")
    slo_ttft_ms: float = _opt(
        500.0, "autoscaling: time-to-first-token SLO for the replicas' p90 over the window "
        "(0: not a signal; NVIDIA Dynamo's planner's --ttft)")
    slo_itl_ms: float = _opt(
        50.0, "autoscaling: inter-token latency SLO for the replicas' p90 over the window "
        "(0: not a signal; Dynamo's planner's --itl)")
    slo_quantile: float = _opt(0.9, "autoscaling: the latency quantile held to the SLOs")
    max_waiting_per_replica: float = _opt(
        8.0, "autoscaling: scale up when more requests than this wait per replica (engine "
        "queues plus requests queued in the router; 0: not a signal)")
    max_kv_usage: float = _opt(0.9, "autoscaling: scale up when a replica's KV cache is "
                               "fuller than this fraction (0: not a signal)")
    downscale_fraction: float = _opt(
        0.5, "autoscaling: scale down only while every signal is under this fraction of its "
        "limit and nothing waits, for --downscale-delay-s")
    downscale_max_busy: float = _opt(
        0.7, "autoscaling: and only while the replicas' engines, busy this fraction of the "
        "window in all, would each be at most this busy with one replica fewer (0: not a "
        "check)")
    upscale_delay_s: float = _opt(0.0, "autoscaling: Ray Serve's upscale_delay_s (how long "
                                  "a scale-up must be wanted before it happens)")
    downscale_delay_s: float = _opt(30.0, "autoscaling: Ray Serve's downscale_delay_s")
    autoscale_window_s: float = _opt(
        10.0, "autoscaling: the window of the latency quantiles (Ray Serve's "
        "look_back_period_s); the planner also waits this long after a move before another "
        "the same way")

    def __post_init__(self) -> None:
        if not self.autoscaling:
            return
        if self.min_replicas < 1:
            raise AutoscalingConfigError("--min-replicas must be at least 1")
        if self.bounds[1] < self.min_replicas:
            raise AutoscalingConfigError(
                f"--max-replicas ({self.bounds[1]}) is below --min-replicas "
                f"({self.min_replicas})")
        if not 0 < self.slo_quantile < 1 or not 0 < self.downscale_fraction < 1:
            raise AutoscalingConfigError(
                "--slo-quantile and --downscale-fraction must be between 0 and 1")
        if not 0 <= self.downscale_max_busy <= 1:
            raise AutoscalingConfigError("--downscale-max-busy must be between 0 and 1")
        if min(self.slo_ttft_ms, self.slo_itl_ms, self.max_waiting_per_replica,
               self.max_kv_usage, self.upscale_delay_s, self.downscale_delay_s) < 0 \
                or self.autoscale_window_s <= 0:
            raise AutoscalingConfigError("the SLOs, limits and delays cannot be negative "
                                         "(and --autoscale-window-s must be positive)")

    @property
    def autoscaling(self) -> bool:
        return self.autoscale or (self.max_replicas is not None
                                  and self.max_replicas > self.min_replicas)

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas under autoscaling."""
        return self.min_replicas, self.max_replicas or max(self.replicas, 2)

    @property
    def on_ray(self) -> bool:
        """Whether `kvserve serve` runs the replicas on Ray Serve."""
        return self.replicas > 1 or self.autoscaling

    @property
    def most_replicas(self) -> int:
        return self.bounds[1] if self.autoscaling else self.replicas
