"""Benchmarks only (`--measure-placement`): how good each placement was, whichever router made
it. Before a request goes out, every replica known to the ingress is asked (its KV events
ROUTER socket, `kvserve.probe`) how many leading blocks of the prompt it caches; once the answer
names the replica that served it, the ingress counts whether that replica held the most, under
`kvserve router`'s metric names (`kvserve_router:placement_*`), which `kvserve bench` reports.
This is the engines' ground truth, so ours and Ray's routers are judged alike.
"""

from __future__ import annotations

import asyncio
import threading

import zmq

from kvserve.kv_events import ReplayClient
from kvserve.router.metrics import RouterMetrics
from kvserve.router.prompts import PromptTokenizer

PROBE_TIMEOUT_SECONDS = 1.0


class PlacementMeter:
    def __init__(self, model: str, metrics: RouterMetrics):
        self.prompts = PromptTokenizer.load(model)
        self.metrics = metrics
        self.context = zmq.Context()
        self.endpoints: dict[str, str] = {}  # replica -> its ROUTER socket, from its answers
        self._clients: dict[str, tuple[threading.Lock, ReplayClient]] = {}

    def learn(self, replica: str, kv_events: dict | None) -> None:
        endpoint = (kv_events or {}).get("replay_endpoint")
        if endpoint:
            self.endpoints[replica] = endpoint

    async def held(self, path: str, payload: dict | None) -> dict[str, int]:
        """Replica -> leading prompt blocks it caches now; empty when the prompt cannot be
        read. A replica that does not answer is left out until it answers a request again."""
        token_ids = self.prompts.token_ids(path, payload)
        if not token_ids:
            return {}
        endpoints = dict(self.endpoints)
        counts = await asyncio.gather(*(asyncio.to_thread(self._probe, name, endpoint,
                                                          token_ids)
                                        for name, endpoint in endpoints.items()))
        held = {}
        for name, count in zip(endpoints, counts):
            if count is None:
                self.endpoints.pop(name, None)
            else:
                held[name] = count
        return held

    def record(self, held: dict[str, int], chosen: str) -> None:
        if chosen not in held or len(held) < 2:
            return
        best = max(held.values())
        self.metrics.placements.inc()
        self.metrics.placements_best.inc(held[chosen] == best)
        self.metrics.chosen_blocks.inc(held[chosen])
        self.metrics.best_blocks.inc(best)

    def _probe(self, name: str, endpoint: str, token_ids: list[int]) -> int | None:
        lock, client = self._clients.get(name, (None, None))
        if client is None or client.endpoint != endpoint:
            lock = threading.Lock()
            client = ReplayClient(self.context, endpoint, PROBE_TIMEOUT_SECONDS)
            self._clients[name] = (lock, client)
        with lock:
            return client.probe(token_ids)
