"""The engine deployment's Ray Serve `autoscaling_config` when autoscaling is on: the SLO
planner (planner.py) as its policy, the bounds, Ray's delays, and the metrics cadence.

Ray records each replica's stats every `look_back_period_s` x 0.2 and pushes them every
`metrics_interval_s` (deprecated by Ray in favour of environment variables that 2.60 does not
read yet, so still the one knob); both follow the window so that a short window also reacts
fast. Free of Ray imports: `build_deployments` passes the dict to `serve.deployment`.
"""

from __future__ import annotations

from kvserve.ray_serve.config import RayServeConfig

PLANNER = "kvserve.ray_serve.planner:SLOPlanner"
RECORD_FRACTION = 0.2  # Ray's RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR default


def push_interval_s(config: RayServeConfig) -> float:
    """How often replicas push their stats to Serve's controller (at most every second)."""
    return min(1.0, config.autoscale_window_s * RECORD_FRACTION)


def planner_kwargs(config: RayServeConfig) -> dict:
    """SLOPlanner's constructor arguments (Ray's `policy_kwargs`, JSON values)."""
    record_s = config.autoscale_window_s * RECORD_FRACTION
    return {"ttft_slo_s": config.slo_ttft_ms / 1000.0, "itl_slo_s": config.slo_itl_ms / 1000.0,
            "max_waiting_per_replica": config.max_waiting_per_replica,
            "max_kv_usage": config.max_kv_usage,
            "downscale_fraction": config.downscale_fraction,
            "downscale_max_busy": config.downscale_max_busy,
            # the replicas' windows have then seen only the fleet after the move
            "settle_s": config.autoscale_window_s + record_s,
            # a replica silent for three reports is not judged on its last one
            "stale_s": 3 * (push_interval_s(config) + record_s)}


def autoscaling_config(config: RayServeConfig) -> dict:
    low, high = config.bounds
    return {"min_replicas": low, "max_replicas": high,
            "initial_replicas": max(low, min(high, config.replicas)),
            "look_back_period_s": config.autoscale_window_s,
            "metrics_interval_s": push_interval_s(config),
            "upscale_delay_s": config.upscale_delay_s,
            "downscale_delay_s": config.downscale_delay_s,
            "policy": {"policy_function": PLANNER, "policy_kwargs": planner_kwargs(config)}}
