"""The SLO planner: a Ray Serve autoscaling policy for the engine replicas (NVIDIA Dynamo's
planner idea on Ray Serve's autoscaler).

Ray Serve calls `SLOPlanner(ctx)` every control-loop tick with an `AutoscalingContext`; the
replicas' custom metrics (slo_stats.py, via `record_autoscaling_stats`) are in
`ctx.raw_metrics`. Ray's wrapper then applies `upscale_delay_s` / `downscale_delay_s` (a move
must be wanted that long in a row) and the `min_replicas` / `max_replicas` bounds, so this
class only says where the fleet should be:

- up, at once, when the worst replica's windowed TTFT or ITL quantile is over its SLO, or
  the waiting requests per replica (engine queues plus the handles' queue) or the KV cache
  usage are over their limits: by the ratio over the limit (at least one replica, at most
  doubling);
- down by one only when every signal is well under its limit (`downscale_fraction`), nothing
  waits, and the work would fit in one replica fewer: the engines' busy fractions over the
  window, summed, at most `downscale_max_busy` of each remaining replica (latency alone says
  nothing of that: two replicas each half busy answer fast, and one would then be
  overloaded; Dynamo's planner sizes from the load for the same reason). Ray's
  `downscale_delay_s` makes that last before it happens;
- otherwise, hold. While a move is under way (running != target) it holds, and after a move
  it makes no second move the same way until a window of metrics has seen the first.

Kept to the standard library: Ray pickles this module by value into its controller.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from kvserve.ray_serve import slo_stats as keys

# it runs in Serve's controller, whose log (logs/serve/controller_*.log) has Serve's logger only
logger = logging.getLogger("ray.serve")

_STATE_KEY = "kvserve_planner"


@dataclass(frozen=True)
class FleetSignals:
    """The replicas' latest reports, reduced: latencies of the worst replica with
    observations in its window (None: no observation anywhere), load summed."""

    ttft_s: float | None
    itl_s: float | None
    num_waiting: float
    num_running: float
    kv_usage: float  # the fullest replica's
    num_replicas: int  # replicas with a fresh report
    busy: float | None = None  # the engines' busy fractions summed (None: none reported)


def latest_reports(raw_metrics: dict | None, now: float, stale_s: float) -> dict:
    """replica -> {metric: value} from each replica's newest point of each metric, for the
    replicas whose latest point is at most `stale_s` old."""
    reports: dict = {}
    for name, by_replica in (raw_metrics or {}).items():
        for replica, series in by_replica.items():
            if series and now - series[-1].timestamp <= stale_s:
                reports.setdefault(replica, {})[name] = series[-1].value
    return {replica: report for replica, report in reports.items()
            if keys.WAITING_KEY in report}


def fleet_signals(reports: dict, queued_at_handles: float = 0.0) -> FleetSignals:
    def worst(value_key: str, count_key: str) -> float | None:
        values = [r.get(value_key, 0.0) for r in reports.values() if r.get(count_key, 0) > 0]
        return max(values) if values else None

    return FleetSignals(
        ttft_s=worst(keys.TTFT_KEY, keys.TTFT_COUNT_KEY),
        itl_s=worst(keys.ITL_KEY, keys.ITL_COUNT_KEY),
        num_waiting=sum(r[keys.WAITING_KEY] for r in reports.values()) + queued_at_handles,
        num_running=sum(r.get(keys.RUNNING_KEY, 0.0) for r in reports.values()),
        kv_usage=max((r.get(keys.KV_USAGE_KEY, 0.0) for r in reports.values()), default=0.0),
        num_replicas=len(reports),
        busy=sum(r[keys.BUSY_KEY] for r in reports.values() if keys.BUSY_KEY in r)
        if any(keys.BUSY_KEY in r for r in reports.values()) else None)


@dataclass(frozen=True)
class Decision:
    num_replicas: int
    reason: str


class SLOPlanner:
    """`policy_kwargs` are this constructor's arguments (Ray instantiates the class once
    per deployment). A limit of 0 or None turns its signal off: a prefill pool would watch
    TTFT only, a decode pool ITL only."""

    def __init__(self, ttft_slo_s: float | None = None, itl_slo_s: float | None = None,
                 max_waiting_per_replica: float | None = 8.0,
                 max_kv_usage: float | None = 0.9, downscale_fraction: float = 0.5,
                 downscale_max_busy: float | None = 0.7, settle_s: float = 10.0,
                 stale_s: float = 10.0):
        self.limits = {"ttft": ttft_slo_s or None, "itl": itl_slo_s or None,
                       "waiting": max_waiting_per_replica or None,
                       "kv": max_kv_usage or None}
        self.downscale_fraction = downscale_fraction
        self.downscale_max_busy = downscale_max_busy or None
        self.settle_s = settle_s
        self.stale_s = stale_s

    # ---- Ray Serve's entry point ---------------------------------------------------------
    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        state = dict(ctx.policy_state.get(_STATE_KEY) or {})
        reports = latest_reports(ctx.raw_metrics, now, self.stale_s)
        signals = fleet_signals(reports, ctx.total_queued_requests or 0.0)
        decision = self.decide(signals, ctx.target_num_replicas, ctx.current_num_replicas,
                               state, now, (ctx.capacity_adjusted_min_replicas,
                                            ctx.capacity_adjusted_max_replicas))
        wanted = decision.num_replicas
        if wanted != ctx.target_num_replicas and wanted != state.get("wanted"):  # once a move
            logger.info("SLO planner: %d -> %d replicas (%s)", ctx.target_num_replicas,
                        decision.num_replicas, decision.reason)
        state.update(wanted=wanted, reason=decision.reason, ttft_s=signals.ttft_s,
                     itl_s=signals.itl_s, num_waiting=signals.num_waiting,
                     kv_usage=signals.kv_usage)
        return wanted, {**ctx.policy_state, _STATE_KEY: state}

    # ---- the decision, on plain values (unit-tested without Ray) -------------------------
    def ratios(self, signals: FleetSignals) -> dict[str, float]:
        """Each signal over its limit (1.0 = at the limit); signals without data are left
        out (no first token in the window: nothing to judge latency by)."""
        per_replica = max(1, signals.num_replicas)
        values = {"ttft": signals.ttft_s, "itl": signals.itl_s,
                  "waiting": signals.num_waiting / per_replica, "kv": signals.kv_usage}
        return {name: values[name] / limit for name, limit in self.limits.items()
                if limit and values[name] is not None}

    def decide(self, signals: FleetSignals, target: int, running: int, state: dict,
               now: float, bounds: tuple[int, int] = (1, 2**31)) -> Decision:
        """Where the fleet should be; `state` (the planner's part of Ray's policy state)
        remembers the last move Ray made and when the fleet reached it."""
        last_target = state.get("target")
        if last_target is not None and target != last_target:
            state.update(last_move="up" if target > last_target else "down", moving=True)
        state["target"] = target
        if running != target:
            state["moving"] = True
            return Decision(target, "scaling: waiting for replicas to start or stop")
        if state.pop("moving", False):
            state["settled_at"] = now
        if signals.num_replicas == 0:
            return Decision(target, "no fresh replica reports")
        ratios = self.ratios(signals)
        name, worst = max(ratios.items(), key=lambda item: item[1], default=("", 0.0))
        low, high = bounds
        if worst > 1.0:
            reason = f"{name} at {worst:.2f}x its limit"
            if target >= high:
                return Decision(high, f"{reason}; at --max-replicas")
            step = max(1, math.ceil(target * min(worst - 1, 1)))
            return self._move(target, min(high, target + step), reason, state, now)
        within = f"within limits ({name or 'no data'} at {worst:.2f}x)"
        if worst < self.downscale_fraction and signals.num_waiting == 0 and target > low:
            after = self._busy_after_downscale(signals, target)
            if after is not None and after > self.downscale_max_busy:
                return Decision(target, f"{within}; one replica fewer would be {after:.2f} "
                                f"busy (over {self.downscale_max_busy:.2f})")
            return self._move(target, target - 1, f"all signals under "
                              f"{self.downscale_fraction:.2f}x their limits", state, now)
        return Decision(target, within)

    def _busy_after_downscale(self, signals: FleetSignals, target: int) -> float | None:
        """How busy each of `target - 1` replicas would be with the window's work (None:
        no check, or no replica reported how busy it was)."""
        if not self.downscale_max_busy or signals.busy is None:
            return None
        return signals.busy / (target - 1)

    def _move(self, target: int, desired: int, reason: str, state: dict,
              now: float) -> Decision:
        """A second move the same way waits until a window of metrics has seen the first."""
        direction = "up" if desired > target else "down"
        if state.get("last_move") == direction and \
                now - state.get("settled_at", -math.inf) < self.settle_s:
            return Decision(target, f"{reason}; settling after scaling {direction}")
        return Decision(desired, reason)
