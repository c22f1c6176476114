"""The kvserve router's placement inside Ray Serve: a `RequestRouter` for the engine replicas.

It runs in the process holding the DeploymentHandle (the ingress), one per handle. Each replica
tells it where it publishes its KV events (`record_replica_metadata`, and again in its routing
stats); an EventSubscriber keeps a KVIndex of the block hashes each replica caches, exactly as
`kvserve router` does (router/index.py, router/subscriber.py). For a request it tokenizes the
prompt as the replica will (router/prompts.py), hashes its full blocks (protocol/block_hash.py),
counts the leading blocks each replica holds, and ranks with router/policy.py's cost: kv-aware
(uncached prompt blocks x weight + blocks in use), least-loaded or round-robin.

Ranks come back as one-replica tiers, best first: Ray Serve sends to the first tier whose
replica is below `max_ongoing_requests`, else the next, and backs off once all were tried.
Blocks in use are the router's own count per request it placed and has not seen complete (its
prompt blocks + 1), plus what the replica's last routing stats showed beyond that count (other
ingress replicas' requests) while those stats are recent.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from typing import List, Optional

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvserve.protocol.block_hash import block_hashes
from kvserve.ray_serve import registry
from kvserve.router.index import DEFAULT_TIER_WEIGHTS, KVIndex
from kvserve.router.policy import Candidate, make_policy
from kvserve.router.prompts import PromptTokenizer, cache_salt_of
from kvserve.router.subscriber import EventSubscriber
from kvserve.zmq_security import endpoint_host, is_loopback

logger = logging.getLogger(__name__)

_TOKEN_CACHE_SIZE = 4096  # prompts tokenized but not yet placed (choose_replicas may repeat)


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, model: str | None = None, policy: str = "kv-aware",
                         overlap_weight: float = 1.0, stale_after: float = 3.0,
                         seed: int | None = None) -> None:
        """`request_router_kwargs`: the replicas' model reference (its tokenizer and chat
        template), the policy, the kv-aware weight, seconds after which a replica's KV events
        or routing stats count as stale."""
        self.policy = make_policy(policy, overlap_weight, seed)
        self.stale_after = stale_after
        self.prompts = PromptTokenizer.load(model) if model and self.policy.uses_overlap \
            else None
        self.index = KVIndex()
        self.subscriber = EventSubscriber(self.index)
        self._subscribed: dict[str, tuple] = {}  # replica -> the endpoints it is tracked at
        self._inflight: dict[str, dict[str, int]] = {}  # replica -> request id -> its blocks
        self._foreign: dict[str, tuple[float, float]] = {}  # replica -> (stats time, blocks)
        self._prompts: OrderedDict[str, tuple[list[int] | None, int]] = OrderedDict()
        deployment = self._deployment_id
        registry.ROUTERS[registry.key(deployment.app_name, deployment.name)] = self

    # ---- replicas come and go ------------------------------------------------------------
    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id for r in replicas}
        for name in [n for n in self._subscribed if n not in current]:
            self._forget(name)
        for replica in replicas:
            self._subscribe(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _subscribe(self, replica: RunningReplica) -> None:
        info = _kv_events(replica)
        if info is None:
            return
        key = (info.get("endpoint"), info.get("replay_endpoint"), info.get("topic"))
        name = replica.replica_id.unique_id
        if self._subscribed.get(name) != key:
            self._subscribed[name] = key
            self.subscriber.track(name, info)

    def _forget(self, name: str) -> None:
        if self._subscribed.pop(name, None) is not None:
            self.subscriber.track(name, None)
        self._inflight.pop(name, None)
        self._foreign.pop(name, None)

    # ---- load ----------------------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        request_id = pending_request.metadata.internal_request_id
        _, prompt_blocks = self._prompts.pop(request_id, (None, 0))
        self._inflight.setdefault(replica_id.unique_id, {})[request_id] = prompt_blocks + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.get(replica_id.unique_id, {}).pop(internal_request_id, None)

    def active_blocks(self, replica: RunningReplica, now: float) -> float:
        name = replica.replica_id.unique_id
        tracked = sum(self._inflight.get(name, {}).values())
        stats = replica.routing_stats or {}
        stats_time = stats.get("time")
        if stats_time is None or now - stats_time > self.stale_after:
            return tracked
        seen = self._foreign.get(name)
        if seen is None or seen[0] != stats_time:  # new stats: what they show beyond our count
            seen = (stats_time, max(0.0, stats.get("kv_blocks_used", 0) - tracked))
            self._foreign[name] = seen
        return tracked + seen[1]

    # ---- placement -----------------------------------------------------------------------
    def prompt(self, pending_request: PendingRequest) -> tuple[list[int] | None, int]:
        """(token ids or None, full blocks) of the request's first prompt, tokenized once."""
        request_id = pending_request.metadata.internal_request_id
        cached = self._prompts.get(request_id)
        if cached is not None:
            return cached
        request = pending_request.args[0] if pending_request.args else None
        token_ids = None
        if self.prompts is not None and hasattr(request, "payload"):
            token_ids = self.prompts.token_ids(request.path, request.payload)
        block_size = next((info.get("block_size") for info in map(
            _kv_events, self.curr_replicas.values()) if info and info.get("block_size")), 16)
        entry = (token_ids, len(token_ids) // block_size if token_ids else 0)
        self._prompts[request_id] = entry
        while len(self._prompts) > _TOKEN_CACHE_SIZE:
            self._prompts.popitem(last=False)
        return entry

    def overlaps(self, candidates: List[RunningReplica], token_ids: list[int],
                 cache_salt: str | None = None) -> dict[str, int]:
        """Leading prompt blocks each candidate holds, by the index (0: no fresh events). A
        salted request's blocks are hashed under its salt, as the replica hashes them."""
        by_size: dict[int, list[str]] = {}
        for replica in candidates:
            self._subscribe(replica)  # its stats may have brought the endpoints
            info = _kv_events(replica) or {}
            name = replica.replica_id.unique_id
            if info.get("block_size") and self.subscriber.fresh(name, self.stale_after):
                by_size.setdefault(info["block_size"], []).append(name)
        overlaps: dict[str, int] = {}
        for size, names in by_size.items():
            overlaps.update(self.index.weighted_overlaps(
                block_hashes(token_ids, size, cache_salt=cache_salt), names,
                DEFAULT_TIER_WEIGHTS))
        return overlaps

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        # every replica is in some tier: once all were tried, wait before trying again
        pending_request.routing_context.should_backoff = True
        token_ids, prompt_blocks = self.prompt(pending_request)
        request = pending_request.args[0] if pending_request.args else None
        salt = cache_salt_of(getattr(request, "payload", None))
        overlaps = self.overlaps(candidate_replicas, token_ids, salt) \
            if token_ids and self.policy.uses_overlap else {}
        now = time.time()
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        # candidates in a fixed order, so round-robin takes them in turn
        candidates = [Candidate(name, overlaps.get(name, 0), self.active_blocks(replica, now))
                      for name, replica in sorted(by_name.items())]
        ranked = self.policy.rank(candidates, prompt_blocks)
        logger.debug("%s: %d prompt blocks; ranked %s", self.policy.name, prompt_blocks,
                     [(c.name, c.overlap_blocks, c.active_blocks) for c in ranked])
        return [[by_name[c.name]] for c in ranked]

    def state(self) -> dict:
        """Per replica: the index's view and the load the router counts (for /router/state)."""
        now = time.time()
        state = {}
        for replica in self.curr_replicas.values():
            name = replica.replica_id.unique_id
            sync = self.subscriber.sync(name)
            state[name] = {"synced": bool(sync and sync.synced),
                           "fresh": self.subscriber.fresh(name, self.stale_after),
                           "last_seq": sync.last_seq if sync else None,
                           "resyncs": sync.num_resyncs if sync else 0,
                           "indexed_blocks": self.index.num_blocks(name),
                           "inflight_requests": len(self._inflight.get(name, {})),
                           "active_blocks": self.active_blocks(replica, now)}
        return state


def _kv_events(replica: RunningReplica) -> dict | None:
    """Where the replica publishes its KV events: its metadata, else its routing stats."""
    info = (replica.replica_metadata or {}).get("kv_events") \
        or (replica.routing_stats or {}).get("kv_events")
    return info if info and info.get("enabled") and _reachable(info) else None


def _reachable(info: dict) -> bool:
    """False for a replica on another node that publishes on loopback (it has no
    KVSERVE_ZMQ_SECRET, so it may not bind its node's address): our 127.0.0.1 is not its."""
    node, host = info.get("node_ip"), endpoint_host(info.get("endpoint") or "")
    return node is None or host is None or not is_loopback(host) or node == _local_node_ip()


@functools.lru_cache(maxsize=1)
def _local_node_ip() -> str:
    from ray.util import get_node_ip_address

    return get_node_ip_address()
