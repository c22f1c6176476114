"""The router's view of the replicas' KV caches: which replica holds which block hash, kept in
step with each replica's event stream.

The hashes are chained and equal across processes (protocol/block_hash.py), so one hash names a
whole prefix and a flat map hash -> replicas is the index; a replica's overlap with a prompt is
the number of the prompt's leading block hashes it holds. `EventSync` applies one replica's
batches in sequence order and heals its view: a gap is replayed from the replica's buffer, else
the replica's snapshot replaces its entries; a new engine instance id (a restart) drops them and
takes a snapshot; a replica silent for longer than `stale_after` counts as holding nothing.

Events with a `medium` other than the pool's (an offload tier's: CPU, DISK) go to one index per
medium: a prompt's run of blocks that continues in a replica's tier counts at that medium's
weight (`weighted_overlaps`), since loading them is dearer than a pool hit and cheaper than a
recompute. Snapshots list the pool only: after a resync a replica's tier blocks are known again
as its tiers next change.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from kvserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)
from kvserve.protocol.block_hash import HASH_ALGORITHM

logger = logging.getLogger(__name__)

POOL_MEDIA = (None, "GPU")  # the replica's own pool (vLLM names its device pool GPU)
# An offload tier's block against a pool hit (llm-d's scorer weighs CPU-tier blocks the same
# way): kvserve's tiers load a block in ~a step against ~16 tokens of prefill for a recompute
DEFAULT_TIER_WEIGHTS = {"CPU": 0.8, "DISK": 0.6}


def parse_tier_weights(text: str) -> dict[str, float]:
    """"CPU=0.8,DISK=0.6" -> {"CPU": 0.8, "DISK": 0.6}; a clear ValueError otherwise."""
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        medium, _, value = part.partition("=")
        try:
            weights[medium.strip()] = float(value)
        except ValueError:
            raise ValueError(f"tier weight {part!r}: expected MEDIUM=NUMBER") from None
        if not 0 <= weights[medium.strip()] <= 1:
            raise ValueError(f"tier weight {part!r}: between 0 and 1")
    return weights


class KVIndex:
    """hash -> replicas holding it, and replica -> its hashes; thread-safe (the subscriber
    thread writes, the router's event loop reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}
        self._hashes: dict[str, set[int]] = {}
        self.tiers: dict[str, KVIndex] = {}  # medium -> what replicas hold in that tier

    def apply(self, replica: str, events: Iterable) -> None:
        pool = []
        for event in events:
            medium = getattr(event, "medium", None)
            if medium in POOL_MEDIA:
                pool.append(event)
            else:
                self.tiers.setdefault(medium, KVIndex())._apply_here(replica, [event])
        self._apply_here(replica, pool)

    def _apply_here(self, replica: str, events: Iterable) -> None:
        """Events applied to this index whatever their medium."""
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(replica, event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._remove(replica, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(replica)

    def replace(self, replica: str, hashes: Iterable[int]) -> None:
        """The replica holds exactly these (a snapshot)."""
        with self._lock:
            self._clear(replica)
            self._store(replica, hashes)

    def clear(self, replica: str) -> None:
        """Forget everything the replica holds, its tiers' blocks included."""
        with self._lock:
            self._clear(replica)
        for tier in list(self.tiers.values()):
            tier.clear(replica)

    def add(self, replica: str, hashes: Iterable[int]) -> None:
        with self._lock:
            self._store(replica, hashes)

    def remove(self, replica: str, hashes: Iterable[int]) -> None:
        with self._lock:
            self._remove(replica, hashes)

    def num_blocks(self, replica: str) -> int:
        return len(self._hashes.get(replica, ()))

    def overlaps(self, hashes: list[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each replica, how many of the leading `hashes` it holds, in one walk."""
        counts = dict.fromkeys(replicas, 0)
        alive = set(counts)
        with self._lock:
            for block_hash in hashes:
                alive &= self._holders.get(block_hash, set())
                if not alive:
                    break
                for replica in alive:
                    counts[replica] += 1
        return counts

    def holds(self, replica: str, block_hash: int) -> bool:
        return replica in self._holders.get(block_hash, ())

    def weighted_overlaps(self, hashes: list[int], replicas: Iterable[str],
                          weights: dict[str, float]) -> dict[str, float]:
        """overlaps(), then the blocks that continue each replica's run in one of its offload
        tiers, each at its medium's weight (the best one where several tiers hold it; a medium
        without a weight counts nothing)."""
        counts = self.overlaps(hashes, replicas)
        result = {replica: float(count) for replica, count in counts.items()}
        if not self.tiers:
            return result
        for replica, count in counts.items():
            for block_hash in hashes[count:]:
                held = [weights.get(medium, 0.0) for medium, tier in self.tiers.items()
                        if tier.holds(replica, block_hash)]
                if not held:
                    break
                result[replica] += max(held)
        return result

    def _store(self, replica: str, hashes: Iterable[int]) -> None:
        mine = self._hashes.setdefault(replica, set())
        for block_hash in hashes:
            self._holders.setdefault(block_hash, set()).add(replica)
            mine.add(block_hash)

    def _remove(self, replica: str, hashes: Iterable[int]) -> None:
        mine = self._hashes.get(replica, set())
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[block_hash]
            mine.discard(block_hash)

    def _clear(self, replica: str) -> None:
        self._remove(replica, list(self._hashes.get(replica, ())))
        self._hashes.pop(replica, None)


ReplayFn = Callable[[int], "list[tuple[int, KVEventBatch]] | None"]
SnapshotFn = Callable[[], "tuple[int, KVSnapshot] | None"]


class EventSync:
    """One replica's event stream applied to the index, in order.

    `replay(start_seq)` and `snapshot()` ask the replica's ROUTER socket (None: no answer in
    time). Without them (a replica publishing no replay endpoint) a gap or restart can only
    start the view again from the live stream: entries from before it are forgotten.
    """

    def __init__(self, replica: str, index: KVIndex, replay: ReplayFn | None = None,
                 snapshot: SnapshotFn | None = None, clock: Callable[[], float] = time.monotonic):
        self.replica = replica
        self.index = index
        self._replay, self._snapshot = replay, snapshot
        self.clock = clock
        self.instance_id: str | None = None
        self.last_seq: int | None = None  # None: not in step with the replica
        self.last_heard = -float("inf")
        self.num_resyncs = self.num_replays = self.num_restarts = 0

    # ---- state ---------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        return self.last_seq is not None

    def fresh(self, stale_after: float) -> bool:
        """In step and heard from within `stale_after` seconds (heartbeats come each second)."""
        return self.synced and self.clock() - self.last_heard <= stale_after

    def reset(self) -> None:
        """Forget the replica's entries (it went away, or its view cannot be trusted)."""
        self.index.clear(self.replica)
        self.last_seq = None
        self.instance_id = None

    # ---- input ---------------------------------------------------------------------------
    def on_batch(self, seq: int, batch: KVEventBatch) -> None:
        self.last_heard = self.clock()
        if self.instance_id is not None and batch.engine_instance_id != self.instance_id:
            logger.info("replica %s restarted (engine instance %s -> %s): resyncing",
                        self.replica, self.instance_id, batch.engine_instance_id)
            self.num_restarts += 1
            self.reset()
        if self.last_seq is None and not self._start(seq, batch):
            return
        if seq <= self.last_seq:
            return  # already in the snapshot or replayed
        if seq > self.last_seq + 1 and not self._recover(seq, batch):
            return
        self._apply(seq, batch)

    def resync(self) -> bool:
        """Replace the replica's entries with its snapshot; False if there is none."""
        answer = self._snapshot() if self._snapshot is not None else None
        if answer is None:
            return False
        seq, snapshot = answer
        if snapshot.hash_algorithm != HASH_ALGORITHM:
            logger.error("replica %s hashes blocks with %s, the router with %s: its cache "
                         "cannot be indexed", self.replica, snapshot.hash_algorithm,
                         HASH_ALGORITHM)
            return False
        self.index.replace(self.replica, snapshot.block_hashes)
        self.instance_id = snapshot.engine_instance_id
        self.last_seq = seq
        self.num_resyncs += 1
        return True

    # ---- recovery ------------------------------------------------------------------------
    def _start(self, seq: int, batch: KVEventBatch) -> bool:
        """Not in step: a snapshot, or (no ROUTER) an empty view from this batch on."""
        if self._snapshot is None:
            self.index.clear(self.replica)
            self.instance_id, self.last_seq = batch.engine_instance_id, seq - 1
            return True
        if self.resync() and self.instance_id == batch.engine_instance_id:
            return True
        self.reset()  # no snapshot, or one of another instance: try again next batch
        return False

    def _recover(self, seq: int, batch: KVEventBatch) -> bool:
        """Batches last_seq+1 .. seq-1 were missed: replay them, else take a snapshot."""
        if self._replay_until(seq):
            return True
        logger.info("replica %s: events %d..%d lost and not replayable: snapshot",
                    self.replica, self.last_seq + 1, seq - 1)
        self.last_seq = None
        if not self._start(seq, batch):
            return False
        return seq > self.last_seq and (seq == self.last_seq + 1 or self._replay_until(seq))

    def _replay_until(self, seq: int) -> bool:
        if self._replay is None:
            return False
        batches = self._replay(self.last_seq + 1)
        if batches is None:
            return False
        self.num_replays += 1
        for replayed_seq, replayed in batches:
            if replayed_seq >= seq:
                break
            if replayed_seq != self.last_seq + 1 \
                    or replayed.engine_instance_id != self.instance_id:
                return False
            self._apply(replayed_seq, replayed)
        return self.last_seq == seq - 1

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        if batch.events:
            self.index.apply(self.replica, batch.events)
        self.last_seq = seq
