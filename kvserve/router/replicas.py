"""The replicas behind the router: health, load, and where they publish their KV events.

Every `interval` seconds each replica's /health is asked (2 s timeout). A replica that fails it,
or fails a request before answering, leaves the candidates and the KV index at once; when
/health answers 200 again it is back: its /kv_events_info is read again (a restarted replica
may publish elsewhere) and the subscriber resyncs it. /metrics gives the load the router cannot
see itself (requests other clients sent), read on the same beat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_SECONDS = 2.0


@dataclass
class Replica:
    url: str
    role: str = "both"  # both (aggregated), prefill or decode (the router's disaggregated mode)
    healthy: bool = False
    events_info: dict | None = None  # its /kv_events_info while healthy
    inflight: dict[int, int] = field(default_factory=dict)  # routed request -> its blocks
    used_blocks: float = 0.0  # KV blocks in use by its last /metrics
    foreign_blocks: float = 0.0  # of those, beyond what the router had in flight there
    num_running: int = 0
    num_waiting: int = 0
    stats_time: float = -float("inf")
    prefix_queries: float = 0.0  # its prefix-cache counters (the benchmark's hit rate)
    prefix_hits: float = 0.0

    @property
    def block_size(self) -> int | None:
        return (self.events_info or {}).get("block_size")

    def active_blocks(self, now: float, stale_after: float) -> float:
        """Blocks it holds or is about to (Dynamo counts them per request it routed): the
        router's own count of the requests it sent there, plus what the replica's last report
        showed beyond the router's count at that moment (other clients' requests), while that
        report is recent."""
        tracked = sum(self.inflight.values())
        if now - self.stats_time > stale_after:
            return tracked
        return tracked + self.foreign_blocks


class ReplicaMonitor:
    def __init__(self, replicas: list[Replica], http: httpx.AsyncClient, subscriber,
                 interval: float = 1.0, headers: dict | None = None, approximate=None):
        """`approximate`: the ApproximateIndex that stands in for the events of replicas
        that publish none (None: such replicas route by load alone)."""
        self.replicas = replicas
        self.http = http
        self.subscriber = subscriber
        self.approximate = approximate
        self.interval = interval
        self.headers = headers or {}

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(replica) for replica in self.replicas))

    async def check(self, replica: Replica) -> None:
        try:
            response = await self.http.get(replica.url + "/health", headers=self.headers,
                                           timeout=HEALTH_TIMEOUT_SECONDS)
            ok, reason = response.status_code == 200, f"/health {response.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            self.mark_down(replica, reason)
            return
        try:
            if not replica.healthy or replica.events_info is None:
                replica.events_info = await self._events_info(replica)
                self.subscriber.track(replica.url, replica.events_info)
                self._guess_without_events(replica)
                replica.healthy = True
                logger.info("replica %s is up (KV events: %s)", replica.url,
                            replica.events_info.get("endpoint") if replica.events_info.get(
                                "enabled") else "none")
            await self._read_metrics(replica)
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(replica, f"{type(exc).__name__}: {exc}")

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("replica %s is down: %s", replica.url, reason)
        replica.healthy = False
        replica.events_info = None
        self.subscriber.track(replica.url, None)
        if self.approximate is not None:
            self.approximate.forget(replica.url)

    def _guess_without_events(self, replica: Replica) -> None:
        """A kvserve replica (it says its block size) without events: the approximate
        index guesses its cache."""
        info = replica.events_info or {}
        if self.approximate is None:
            return
        if info.get("enabled") or not info.get("block_size"):
            self.approximate.forget(replica.url)
        else:
            self.approximate.track(replica.url, info.get("num_kv_blocks") or 0)

    async def _events_info(self, replica: Replica) -> dict:
        response = await self.http.get(replica.url + "/kv_events_info", headers=self.headers,
                                       timeout=HEALTH_TIMEOUT_SECONDS)
        if response.status_code == 404:  # not a kvserve replica: routed by load alone
            return {"enabled": False}
        response.raise_for_status()
        return response.json()

    async def _read_metrics(self, replica: Replica) -> None:
        """The replica's load beyond the router's own requests. Its report shows some moment
        while the GET was out, so every request the router had there at any time in that
        window counts as the router's: one that finished meanwhile is not someone else's
        load (counting it so sent a session's next turn away from its cache for a beat)."""
        routed_while_asking = dict(replica.inflight)
        response = await self.http.get(replica.url + "/metrics", headers=self.headers,
                                       timeout=HEALTH_TIMEOUT_SECONDS)
        if response.status_code != 200:
            return
        routed_while_asking.update(replica.inflight)
        values = parse_metrics(response.text)
        blocks = (replica.events_info or {}).get("num_kv_blocks") or 0
        replica.used_blocks = values.get("kvserve:kv_cache_usage_perc", 0.0) * blocks
        replica.foreign_blocks = max(0.0, replica.used_blocks
                                     - sum(routed_while_asking.values()))
        replica.num_running = int(values.get("kvserve:num_requests_running", 0))
        replica.num_waiting = int(values.get("kvserve:num_requests_waiting", 0))
        replica.prefix_queries = values.get("kvserve:prefix_cache_queries_total", 0.0)
        replica.prefix_hits = values.get("kvserve:prefix_cache_hits_total", 0.0)
        replica.stats_time = time.monotonic()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
