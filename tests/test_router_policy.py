"""The router's index, its resync logic and its policies, without a model: fake replays and
snapshots, a fake clock, a real block pool as the event source, and real ZeroMQ publishers in
this process for the subscriber thread."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)
from kvserve.protocol.block_hash import HASH_ALGORITHM, block_hashes
from kvserve.router.index import EventSync, KVIndex, parse_tier_weights
from kvserve.router.policy import Candidate, make_policy
from kvserve.router.replicas import Replica, ReplicaMonitor
from kvserve.router.subscriber import EventSubscriber, reachable_endpoint
from kvserve.sampling_params import SamplingParams
from kvserve.testing.server import free_port
from tests.helpers import EVENT_BLOCK, cache_tokens, kv_event_publisher, wait_until

BLOCK = EVENT_BLOCK


def stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * BLOCK * len(hashes), BLOCK)


def batch(*events, instance: str = "A") -> KVEventBatch:
    return KVEventBatch(time.time(), list(events), None, instance)


class FakeReplica:
    """A replica's ROUTER: a ring of (seq, batch) and a snapshot to hand out."""

    def __init__(self, instance: str = "A"):
        self.ring: list[tuple[int, KVEventBatch]] = []
        self.snapshot_answer: tuple[int, KVSnapshot] | None = None
        self.instance = instance
        self.replays = self.snapshots = 0

    def replay(self, start: int):
        self.replays += 1
        return [(seq, b) for seq, b in self.ring if seq >= start]

    def snapshot(self):
        self.snapshots += 1
        return self.snapshot_answer

    def set_snapshot(self, seq: int, hashes: list[int], instance: str | None = None):
        self.snapshot_answer = (seq, KVSnapshot(instance or self.instance, BLOCK,
                                                HASH_ALGORITHM, hashes))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_sync(replica: FakeReplica | None = None, clock=None):
    index = KVIndex()
    replica = replica or FakeReplica()
    sync = EventSync("r", index, replica.replay, replica.snapshot, clock or Clock())
    return index, sync, replica


def held(index: KVIndex, replica: str = "r") -> set[int]:
    return set(index._hashes.get(replica, ()))


# ---- the index --------------------------------------------------------------------------------
def test_overlap_counts_leading_blocks_per_replica():
    index = KVIndex()
    index.apply("a", [stored(1, 2, 3)])
    index.apply("b", [stored(1, 2), stored(9)])
    assert index.overlaps([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    assert index.overlaps([9, 3], ["a", "b"]) == {"a": 0, "b": 1}
    index.apply("a", [BlockRemoved([2])])
    assert index.overlaps([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    index.replace("b", [5])
    assert index.overlaps([1, 2], ["a", "b"]) == {"a": 1, "b": 0}
    index.clear("a")
    assert index.num_blocks("a") == 0 and index._holders == {5: {"b"}}


def test_blocks_in_a_replicas_offload_tiers_count_at_their_mediums_weight():
    """A run that continues in a tier (CPU, DISK events) counts each such block at the tier's
    weight after the pool's own; a pool snapshot leaves the tiers' view alone, forgetting the
    replica clears both."""
    index = KVIndex()
    weights = parse_tier_weights("CPU=0.8,DISK=0.5")
    index.apply("a", [stored(1, 2)])
    index.apply("a", [BlockStored([3, 4], None, [], BLOCK, medium="CPU"),
                      BlockStored([5], None, [], BLOCK, medium="DISK")])
    index.apply("b", [stored(1, 2, 3)])
    got = index.weighted_overlaps([1, 2, 3, 4, 5, 6], ["a", "b"], weights)
    assert got == pytest.approx({"a": 2 + 0.8 + 0.8 + 0.5, "b": 3.0})
    assert index.overlaps([1, 2, 3], ["a"]) == {"a": 2}  # the pool's own count is unchanged
    index.apply("a", [BlockRemoved([4], medium="CPU")])  # the run stops at the gap
    assert index.weighted_overlaps([1, 2, 3, 4, 5], ["a"], weights) == pytest.approx({"a": 2.8})
    index.replace("a", [1])
    assert index.weighted_overlaps([1, 2, 3], ["a"], weights) == {"a": 1.0}  # 2 left the pool
    index.replace("a", [1, 2])
    assert index.weighted_overlaps([1, 2, 3], ["a"], {}) == {"a": 2.0}  # no weight: nothing
    index.clear("a")
    assert index.weighted_overlaps([1, 2, 3], ["a"], weights) == {"a": 0.0}
    with pytest.raises(ValueError, match="MEDIUM=NUMBER"):
        parse_tier_weights("CPU")
    with pytest.raises(ValueError, match="between 0 and 1"):
        parse_tier_weights("CPU=2")


# ---- staying in step --------------------------------------------------------------------------
def test_connect_takes_a_snapshot_then_applies_later_batches_only():
    index, sync, replica = make_sync()
    replica.set_snapshot(4, [1, 2])
    sync.on_batch(3, batch(stored(7)))  # older than the snapshot: already in it
    assert sync.last_seq == 4 and held(index) == {1, 2} and replica.snapshots == 1
    sync.on_batch(5, batch(stored(3)))
    assert held(index) == {1, 2, 3} and sync.last_seq == 5 and replica.replays == 0


def test_a_gap_is_replayed():
    index, sync, replica = make_sync()
    replica.set_snapshot(0, [])
    sync.on_batch(1, batch(stored(1)))
    replica.ring = [(2, batch(stored(2))), (3, batch(BlockRemoved([1]))), (4, batch(stored(4)))]
    sync.on_batch(4, batch(stored(4)))
    assert replica.replays == 1 and replica.snapshots == 1
    assert held(index) == {2, 4} and sync.last_seq == 4


def test_a_gap_older_than_the_replay_buffer_takes_a_snapshot():
    index, sync, replica = make_sync()
    replica.set_snapshot(0, [])
    sync.on_batch(1, batch(stored(1)))
    replica.ring = [(5, batch(stored(5)))]  # 2..4 are gone
    replica.set_snapshot(6, [1, 5, 6])
    sync.on_batch(7, batch(stored(7)))
    assert replica.snapshots == 2 and held(index) == {1, 5, 6, 7} and sync.last_seq == 7
    assert sync.num_resyncs == 2


def test_a_new_instance_id_drops_the_view_and_resyncs():
    index, sync, replica = make_sync()
    replica.set_snapshot(10, [1, 2, 3])
    sync.on_batch(11, batch(stored(4)))
    assert held(index) == {1, 2, 3, 4}
    replica.set_snapshot(0, [], instance="B")  # restarted: empty, counting from 0 again
    sync.on_batch(1, batch(stored(8), instance="B"))
    assert sync.instance_id == "B" and held(index) == {8} and sync.num_restarts == 1


def test_a_snapshot_of_another_instance_is_not_trusted():
    index, sync, replica = make_sync()
    replica.set_snapshot(3, [1], instance="OLD")
    sync.on_batch(4, batch(stored(2), instance="NEW"))
    assert not sync.synced and held(index) == set()
    replica.set_snapshot(3, [1], instance="NEW")
    sync.on_batch(4, batch(stored(2), instance="NEW"))
    assert sync.synced and held(index) == {1, 2}


def test_no_snapshot_answer_leaves_the_replica_unsynced_until_one_comes():
    index, sync, replica = make_sync()
    sync.on_batch(1, batch(stored(1)))
    assert not sync.synced and held(index) == set()
    replica.set_snapshot(1, [1])
    sync.on_batch(2, batch(stored(2)))
    assert sync.synced and held(index) == {1, 2}


def test_without_a_replay_socket_the_view_starts_from_the_live_stream():
    index = KVIndex()
    sync = EventSync("r", index, None, None, Clock())
    sync.on_batch(7, batch(stored(1)))
    sync.on_batch(9, batch(stored(2)))  # gap: cannot recover, starts again from here
    assert held(index) == {2} and sync.last_seq == 9


def test_silence_makes_a_replica_stale():
    clock = Clock()
    index, sync, replica = make_sync(clock=clock)
    replica.set_snapshot(0, [1])
    sync.on_batch(1, batch())
    assert sync.fresh(3.0)
    clock.now += 3.5
    assert not sync.fresh(3.0)
    sync.on_batch(2, batch())  # a heartbeat
    assert sync.fresh(3.0)


def test_a_foreign_hash_algorithm_is_refused():
    index, sync, replica = make_sync()
    replica.snapshot_answer = (0, KVSnapshot("A", BLOCK, "python-hash", [1]))
    assert not sync.resync() and held(index) == set()


def test_lossy_stream_with_replay_and_snapshots_ends_equal_to_the_pool():
    """A real block pool under random traffic; batches are lost at random (some older than
    the replay ring): the index always ends holding exactly the pool's cached hashes."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK)
    kv.pool.enable_events()
    index, sync, replica = make_sync()
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
    seq = -1
    replica.set_snapshot(seq, [])
    for step in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(12))]
        request = Request(str(step), tokens, SamplingParams(), max_tokens=4)
        blocks, hit = kv.get_computed_blocks(request)
        if kv.allocate_slots(request, request.num_tokens - hit, blocks):
            request.num_computed_tokens = request.num_tokens
            kv.cache_computed_blocks(request)
            kv.free(request)
        if step % 97 == 0:
            kv.reset_prefix_cache()
        events = kv.pool.take_events()
        if not events:
            continue
        seq += 1
        live = batch(*events)
        replica.ring = (replica.ring + [(seq, live)])[-3:]
        replica.set_snapshot(seq, list(kv.pool.cached))
        if rng.random() < 0.3:
            continue  # lost on the way
        sync.on_batch(seq, live)
        assert held(index) == set(kv.pool.cached)
    assert sync.num_replays > 0 and sync.num_resyncs > 1


# ---- policies ---------------------------------------------------------------------------------
def test_kv_aware_weighs_uncached_blocks_against_load():
    policy = make_policy("kv-aware", overlap_weight=1.0, seed=0)
    a, b = Candidate("a", overlap_blocks=10, active_blocks=5), Candidate("b", 0, 0)
    assert [c.name for c in policy.rank([b, a], prompt_blocks=12)] == ["a", "b"]  # 7 < 12
    busy = Candidate("a", overlap_blocks=10, active_blocks=20)
    assert [c.name for c in policy.rank([busy, b], prompt_blocks=12)] == ["b", "a"]  # 12 < 22
    heavy = make_policy("kv-aware", overlap_weight=3.0, seed=0)
    assert heavy.rank([busy, b], prompt_blocks=12)[0].name == "a"  # 26 < 36


def test_ties_are_broken_at_random():
    policy = make_policy("kv-aware", seed=1)
    firsts = {policy.rank([Candidate("a", 0, 0), Candidate("b", 0, 0)], 4)[0].name
              for _ in range(50)}
    assert firsts == {"a", "b"}


def test_least_loaded_and_round_robin():
    least = make_policy("least-loaded", seed=0)
    ranked = least.rank([Candidate("a", 9, 3), Candidate("b", 0, 1), Candidate("c", 0, 2)], 9)
    assert [c.name for c in ranked] == ["b", "c", "a"]
    rr = make_policy("round-robin")
    candidates = [Candidate("a", 0, 0), Candidate("b", 0, 0)]
    assert [rr.rank(candidates, 0)[0].name for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError):
        make_policy("random")


def test_reachable_endpoint():
    url = "http://10.1.2.3:8000"
    assert reachable_endpoint("tcp://*:5557", url) == "tcp://10.1.2.3:5557"
    assert reachable_endpoint("tcp://0.0.0.0:5557", url) == "tcp://10.1.2.3:5557"
    assert reachable_endpoint("tcp://127.0.0.1:5557", url) == "tcp://127.0.0.1:5557"
    assert reachable_endpoint("ipc:///tmp/kv", url) == "ipc:///tmp/kv"
    assert reachable_endpoint(None, url) is None


# ---- the subscriber thread against real publishers --------------------------------------------
def test_subscriber_syncs_follows_restarts_and_notices_silence():
    pub_port, replay_port = free_port(), free_port()
    info = {"enabled": True, "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": ""}
    kv, source = kv_event_publisher(pub_port, replay_port)
    cache_tokens(kv, source, list(range(20)))  # before the router connects: from the snapshot
    index = KVIndex()
    subscriber = EventSubscriber(index, replay_timeout=2.0)
    try:
        subscriber.track("r", info)
        wait_until(lambda: held(index) == set(kv.pool.cached) and len(kv.pool.cached) == 5)
        cache_tokens(kv, source, list(range(100, 120)))  # live
        wait_until(lambda: held(index) == set(kv.pool.cached) and len(kv.pool.cached) == 10)
        assert subscriber.fresh("r", 1.0)
        first_instance = subscriber.sync("r").instance_id
        source.close()  # the replica "dies": heartbeats stop
        wait_until(lambda: not subscriber.fresh("r", 0.6))
        kv, source = kv_event_publisher(pub_port, replay_port)  # restarted on the same ports
        cache_tokens(kv, source, list(range(200, 212)))
        wait_until(lambda: held(index) == set(kv.pool.cached)
              and subscriber.sync("r").instance_id != first_instance)
        assert block_hashes(list(range(200, 212)), BLOCK)[0] in held(index)
        assert not held(index) & set(block_hashes(list(range(20)), BLOCK))
        subscriber.track("r", None)  # the replica left: its entries go
        wait_until(lambda: held(index) == set() and subscriber.sync("r") is None)
    finally:
        subscriber.close()
        source.close()


# ---- replica health ---------------------------------------------------------------------------
class FakeSubscriber:
    def __init__(self):
        self.tracked: list[tuple[str, dict | None]] = []

    def track(self, replica, info):
        self.tracked.append((replica, info))


def test_a_replica_leaves_when_health_fails_and_returns_resubscribed():
    health = {"status": 200}
    info = {"enabled": True, "endpoint": "tcp://127.0.0.1:1", "block_size": 16,
            "num_kv_blocks": 100}
    metrics = "kvserve:kv_cache_usage_perc 0.25\nkvserve:num_requests_running 2\n"

    def answer(request: httpx.Request) -> httpx.Response:
        if health["status"] is None:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(health["status"])
        if request.url.path == "/kv_events_info":
            return httpx.Response(200, json=info)
        return httpx.Response(200, text=metrics)

    async def scenario():
        replica = Replica("http://r")
        subscriber = FakeSubscriber()
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            monitor = ReplicaMonitor([replica], http, subscriber)
            await monitor.check_all()
            assert replica.healthy and subscriber.tracked == [("http://r", info)]
            assert replica.used_blocks == 25 and replica.num_running == 2
            replica.inflight[1] = 10  # the router's own request: not foreign load
            assert replica.active_blocks(time.monotonic(), 3.0) == 35
            health["status"] = 503
            await monitor.check_all()
            assert not replica.healthy and subscriber.tracked[-1] == ("http://r", None)
            health["status"] = None  # refused
            await monitor.check_all()
            assert not replica.healthy
            health["status"] = 200
            await monitor.check_all()
            assert replica.healthy and subscriber.tracked[-1] == ("http://r", info)
            assert replica.foreign_blocks == 15  # 25 in use, 10 of them the router's

    asyncio.run(scenario())


def test_a_request_that_finishes_while_the_metrics_are_read_is_not_foreign_load():
    """The report shows the replica while the router's own request still ran; that request
    finished before the answer came back. It is still the router's, not another client's:
    counting it as foreign once sent a session's next turn away from its cache."""
    info = {"enabled": True, "endpoint": "tcp://127.0.0.1:1", "block_size": 16,
            "num_kv_blocks": 100}
    replica = Replica("http://r")

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/kv_events_info":
            return httpx.Response(200, json=info)
        replica.inflight.pop(1, None)  # answered while the report was on its way
        return httpx.Response(200, text="kvserve:kv_cache_usage_perc 0.3\n")

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            monitor = ReplicaMonitor([replica], http, FakeSubscriber())
            replica.inflight[1] = 25
            await monitor.check_all()
            assert replica.used_blocks == 30 and replica.foreign_blocks == 5
            assert replica.active_blocks(time.monotonic(), 3.0) == 5

    asyncio.run(scenario())
