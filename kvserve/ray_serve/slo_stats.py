"""What an engine replica tells the SLO planner (planner.py) through Ray Serve's
`record_autoscaling_stats`: its TTFT and inter-token latency quantiles over a recent window,
its queue and KV cache load, and how busy its engine was over the window (the step ledger's
seconds of steps per second: what one replica fewer would have to absorb).

The latencies come from the engine's own Prometheus histograms (metrics.py), so the planner
sees what `/metrics` shows: the window's counts are the difference of the cumulative bucket
counts now and one window ago, and the quantile is interpolated inside its bucket as
Prometheus' `histogram_quantile` does (so its resolution is the buckets').
"""

from __future__ import annotations

import math
from collections import deque

TTFT_HISTOGRAM = "kvserve:time_to_first_token_seconds"
ITL_HISTOGRAM = "kvserve:inter_token_latency_seconds"

# the keys of the stats dict (Ray Serve's custom autoscaling metrics: name -> float)
TTFT_KEY = "ttft_quantile_s"
TTFT_COUNT_KEY = "ttft_count"
ITL_KEY = "itl_quantile_s"
ITL_COUNT_KEY = "itl_count"
WAITING_KEY = "num_waiting"
RUNNING_KEY = "num_running"
KV_USAGE_KEY = "kv_usage"
BUSY_KEY = "busy_fraction"

Buckets = list[tuple[float, float]]  # (upper bound, cumulative count), ascending, +Inf last


def read_histograms(registry, names: tuple[str, ...]) -> dict[str, Buckets]:
    """Each named histogram's cumulative bucket counts, summed over its label sets, in one
    pass over the registry."""
    counts: dict[str, dict[float, float]] = {name: {} for name in names}
    for metric in registry.collect():
        if metric.name not in counts:
            continue
        into = counts[metric.name]
        for sample in metric.samples:
            if sample.name == metric.name + "_bucket":
                bound = float(sample.labels["le"])
                into[bound] = into.get(bound, 0.0) + sample.value
    return {name: sorted(buckets.items()) for name, buckets in counts.items()}


def bucket_quantile(quantile: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile on cumulative buckets: linear inside the bucket that
    holds the rank; in the +Inf bucket, the highest finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = quantile * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def subtract(now: Buckets, before: Buckets) -> Buckets:
    """The counts observed between two snapshots of one histogram (same bounds)."""
    earlier = dict(before)
    return [(bound, count - earlier.get(bound, 0.0)) for bound, count in now]


class WindowedLatency:
    """Quantiles of the observations of the last `window_s` seconds of cumulative
    histograms, from snapshots taken whenever `sample` is called (Ray calls it every
    look_back_period_s x 0.2)."""

    def __init__(self, window_s: float, quantile: float = 0.9):
        self.window_s = window_s
        self.quantile = quantile
        self._snapshots: deque[tuple[float, dict[str, Buckets]]] = deque()

    def sample(self, now: float, histograms: dict[str, Buckets]) -> dict[str, tuple]:
        """name -> (quantile or None, observations) over the window ending now. The baseline
        is the newest snapshot at least a window old; until one is, nothing (a replica's
        first window counts everything since it started)."""
        self._snapshots.append((now, histograms))
        while len(self._snapshots) > 1 and now - self._snapshots[1][0] >= self.window_s:
            self._snapshots.popleft()
        oldest_time, oldest = self._snapshots[0]
        baseline = oldest if now - oldest_time >= self.window_s else {}
        result = {}
        for name, buckets in histograms.items():
            window = subtract(buckets, baseline.get(name, []))
            count = window[-1][1] if window else 0.0
            result[name] = (bucket_quantile(self.quantile, window), count)
        return result


class WindowedRate:
    """A cumulative counter's growth per second over the last `window_s` seconds, from the
    points `sample` is given (the baseline as WindowedLatency's: the newest point at least a
    window old, else the oldest). A counter that went back (a restarted core) reads 0."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._points: deque[tuple[float, float]] = deque()

    def sample(self, now: float, value: float) -> float:
        self._points.append((now, value))
        while len(self._points) > 1 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()
        then, before = self._points[0]
        return max(0.0, (value - before) / (now - then)) if now > then else 0.0


class SLOStats:
    """The replica's side: `stats(now, scheduler_stats)` is the dict Ray Serve's
    record_autoscaling_stats returns (floats only; a latency without observations is 0 with
    a count of 0, and the planner skips it)."""

    def __init__(self, registry, window_s: float, quantile: float = 0.9):
        self.registry = registry
        self.latency = WindowedLatency(window_s, quantile)
        self.busy = WindowedRate(window_s)

    def stats(self, now: float, scheduler_stats) -> dict[str, float]:
        histograms = read_histograms(self.registry, (TTFT_HISTOGRAM, ITL_HISTOGRAM))
        window = self.latency.sample(now, histograms)
        (ttft, ttft_count), (itl, itl_count) = window[TTFT_HISTOGRAM], window[ITL_HISTOGRAM]
        busy = self.busy.sample(now, scheduler_stats.step_seconds if scheduler_stats else 0.0)
        return {BUSY_KEY: min(1.0, busy),TTFT_KEY: ttft or 0.0, TTFT_COUNT_KEY: ttft_count,
                ITL_KEY: itl or 0.0, ITL_COUNT_KEY: itl_count,
                WAITING_KEY: float(scheduler_stats.num_waiting if scheduler_stats else 0),
                RUNNING_KEY: float(scheduler_stats.num_running if scheduler_stats else 0),
                KV_USAGE_KEY: float(scheduler_stats.kv_usage if scheduler_stats else 0.0)}
