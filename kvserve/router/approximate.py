"""What the router sent to replicas that publish no KV events, as an approximate index (the
idea of SGLang's cache-aware router): a routed prompt's block hashes are taken to be cached
where it ran, least recently routed out first beyond the replica's pool size. It does not see
what a replica evicts early, other clients' requests, or answers' tokens, so it is a guess:
events give the truth, and a replica publishes them unless told not to."""

from __future__ import annotations

import logging
from collections import OrderedDict

from kvserve.router.index import KVIndex

logger = logging.getLogger(__name__)


class ApproximateIndex:
    def __init__(self, index: KVIndex):
        self.index = index
        self._routed: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def track(self, replica: str, capacity_blocks: int) -> None:
        """Start guessing for `replica` (its pool holds `capacity_blocks` blocks)."""
        if replica not in self._routed:
            logger.warning("replica %s publishes no KV events: the router guesses its cache "
                           "from the prompts it sent there (start it without "
                           "'enable_kv_cache_events: false' for exact routing)", replica)
        self._routed.setdefault(replica, OrderedDict())
        self._capacity[replica] = max(1, capacity_blocks)

    def forget(self, replica: str) -> None:
        if self._routed.pop(replica, None) is not None:
            self.index.clear(replica)
        self._capacity.pop(replica, None)

    def covers(self, replica: str) -> bool:
        return replica in self._routed

    def routed(self, replica: str, block_hashes: list[int]) -> None:
        """A prompt with these block hashes ran on `replica`."""
        routed = self._routed.get(replica)
        if routed is None:
            return
        new = [h for h in block_hashes if h not in routed]
        for block_hash in block_hashes:
            routed[block_hash] = None
            routed.move_to_end(block_hash)
        evicted = []
        while len(routed) > self._capacity[replica]:
            evicted.append(routed.popitem(last=False)[0])
        self.index.add(replica, new)
        self.index.remove(replica, evicted)
