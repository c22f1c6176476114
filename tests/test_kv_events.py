"""Stable block hashes, KV events from the block pool, and the ZeroMQ publisher's wire (PUB,
replay, snapshot, probe, heartbeat) in one process over loopback TCP."""

from __future__ import annotations

import multiprocessing
import time

import msgspec
import pytest
import zmq

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ReplayClient,
    make_kv_event_source,
    parse_kv_events_config,
    seq_from_bytes,
)
from kvserve.protocol.block_hash import ROOT_HASH, block_hashes, hash_block_tokens
from kvserve.testing.server import free_port
from tests.helpers import admit, bounded, make_request

BLOCK = 4
TOKENS = [list(range(i, i + 37)) for i in (0, 1000, 50000)]


# ---- hashing ----------------------------------------------------------------------------------
def _hashes_here(token_lists: list[list[int]]) -> list[list[int]]:
    return [block_hashes(tokens, BLOCK) for tokens in token_lists]


def test_block_hashes_are_equal_in_a_spawned_process():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        theirs = pool.apply(_hashes_here, (TOKENS,))
    assert theirs == _hashes_here(TOKENS)


def test_block_hashes_chain_and_fit_64_bits():
    hashes = block_hashes(TOKENS[0], BLOCK)
    assert len(hashes) == 37 // BLOCK
    assert hashes[0] == hash_block_tokens(None, TOKENS[0][:BLOCK])
    assert hashes[1] == hash_block_tokens(hashes[0], TOKENS[0][BLOCK:2 * BLOCK])
    assert all(0 <= h < 2**64 for h in hashes) and len(set(hashes)) == len(hashes)
    # same tokens under another parent: another hash (the chain names the whole prefix)
    assert hash_block_tokens(ROOT_HASH + 1, TOKENS[0][:BLOCK]) != hashes[0]
    assert block_hashes(TOKENS[0], BLOCK, max_blocks=2) == hashes[:2]


def test_the_kv_manager_uses_the_stable_hashes():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    request = make_request("a", TOKENS[0])
    admit(kv, request)
    assert request.block_hashes == block_hashes(TOKENS[0], BLOCK)
    assert set(kv.pool.cached) == set(request.block_hashes)
    assert kv.num_cached_prefix_blocks(TOKENS[0]) == 37 // BLOCK
    assert kv.num_cached_prefix_blocks(TOKENS[0][:BLOCK * 3] + [7] * 8) == 3
    assert kv.num_cached_prefix_blocks(TOKENS[1]) == 0


def test_a_hash_collision_is_a_miss():
    """Hits stay confirmed against the tokens: a forged entry under the right hash with other
    tokens is not served."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    admit(kv, make_request("a", TOKENS[0]))
    first = block_hashes(TOKENS[0], BLOCK)[0]
    block = kv.pool.cached[first]
    block.block_key = (None, (9, 9, 9, 9), None)
    again = make_request("b", TOKENS[0])
    assert kv.get_computed_blocks(again) == (([],), 0)


# ---- events from the block pool -----------------------------------------------------------
def test_pool_records_stored_removed_and_cleared():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    kv.pool.enable_events()
    first = make_request("a", list(range(9)))  # 2 full blocks + 1 partial
    admit(kv, first)
    hashes = block_hashes(first.all_token_ids, BLOCK)
    events = kv.pool.take_events()
    assert events == [BlockStored(hashes, None, list(range(8)), BLOCK)]  # one merged event
    assert kv.pool.take_events() == []
    kv.free(first)
    # 4 blocks: the partial one and the free one first, then the cached ones (LRU) are evicted
    second = make_request("b", list(range(100, 113)))
    admit(kv, second)
    events = kv.pool.take_events()
    assert events[0] == BlockRemoved([hashes[1], hashes[0]])  # tail freed first, evicted first
    assert events[1] == BlockStored(block_hashes(second.all_token_ids, BLOCK), None,
                                    list(range(100, 112)), BLOCK)
    kv.free(second)
    assert kv.reset_prefix_cache()
    assert kv.pool.take_events() == [AllBlocksCleared()]


def test_events_off_records_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    admit(kv, make_request("a", list(range(9))))
    assert kv.pool.events is None


def test_a_stored_chain_continues_its_parent():
    """A request extending a cached prefix stores its next blocks with the prefix's last hash
    as parent (the subscriber may link them)."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    kv.pool.enable_events()
    admit(kv, make_request("a", list(range(9))))
    kv.pool.take_events()
    longer = make_request("b", list(range(17)))
    assert admit(kv, longer) == 8
    hashes = block_hashes(longer.all_token_ids, BLOCK)
    assert kv.pool.take_events() == [BlockStored(hashes[2:], hashes[1], list(range(8, 16)),
                                                 BLOCK)]


# ---- configuration --------------------------------------------------------------------------
def test_config_parsing():
    assert parse_kv_events_config(None) is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config.publisher == "zmq" and config.publishes
    assert parse_kv_events_config({"enable_kv_cache_events": False}).publisher == "null"
    for bad, word in (('{"enable_kv_cache_events": true, "endpoint": "localhost:1"}', "ZeroMQ"),
                      ('{"bogus": 1}', "unknown"), ("{", "JSON"),
                      ('{"publisher": "kafka"}', "kafka"),
                      ('{"endpoint": "tcp://127.0.0.1:*"}', "fixed port")):
        with pytest.raises(ValueError, match=word):
            parse_kv_events_config(bad)


def test_engine_config_rejects_a_bad_kv_events_config():
    from kvserve.engine_config import EngineConfig

    with pytest.raises(ValueError, match="unknown"):
        EngineConfig(kv_events_config='{"enable": true}')


# ---- the publisher --------------------------------------------------------------------------
@pytest.fixture
def published():
    """A KV manager whose events go out on loopback PUB/ROUTER sockets; a subscriber."""
    pub_port, replay_port = free_port(), free_port()
    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:%d", '
              '"replay_endpoint": "tcp://127.0.0.1:%d", "topic": "kv", "buffer_steps": 3}'
              % (pub_port, replay_port))
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    source = make_kv_event_source(config, kv)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    replay = ReplayClient(context, f"tcp://127.0.0.1:{replay_port}", timeout=5.0)
    yield kv, source, sub, replay
    replay.close()
    sub.close(linger=0)
    context.term()
    source.close()


def _receive(sub, timeout=5.0) -> tuple[int, KVEventBatch]:
    assert sub.poll(int(timeout * 1000)), "no batch published"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv"
    return seq_from_bytes(seq), msgspec.msgpack.decode(payload, type=KVEventBatch)


def test_publisher_heartbeats_then_publishes_numbered_batches(published):
    kv, source, sub, replay = published
    seq, batch = _receive(sub)  # a heartbeat (the subscription took hold meanwhile)
    assert batch.events == [] and len(batch.engine_instance_id) == 32
    instance = batch.engine_instance_id
    admit(kv, make_request("a", list(range(9))))
    source.flush()
    for _ in bounded(100, "waiting for the stored block's event"):
        next_seq, batch = _receive(sub)
        assert next_seq == seq + 1
        seq = next_seq
        if batch.events:
            break
    assert batch.events == [BlockStored(block_hashes(list(range(9)), BLOCK), None,
                                        list(range(8)), BLOCK)]
    assert batch.engine_instance_id == instance
    source.flush()  # nothing new: nothing sent
    assert source.publisher.last_seq >= seq


def test_replay_snapshot_and_probe(published):
    kv, source, sub, replay = published
    _receive(sub)
    requests = [make_request(str(i), [i * 100 + t for t in range(9)]) for i in range(5)]
    for request in requests:
        admit(kv, request)
        source.flush()
    last = source.publisher.last_seq
    time.sleep(0.2)  # the thread sends them
    replayed = dict(replay.replay(0))
    assert sorted(replayed) == list(range(last - 2, last + 1))  # the ring keeps 3
    assert replayed[last].events[0].token_ids == list(range(400, 408))
    assert replay.replay(last + 1) == []
    seq, snapshot = replay.snapshot()
    assert seq >= last and set(snapshot.block_hashes) == set(kv.pool.cached)
    assert snapshot.block_size == BLOCK and len(snapshot.block_hashes) == 10
    assert replay.probe([300 + t for t in range(9)] + [1, 2, 3]) == 2
    assert replay.probe([5, 6, 7]) == 0


def test_publisher_drops_when_its_queue_is_full():
    pub_port = free_port()
    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:%d", '
              '"max_queue_size": 1}' % pub_port)
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    source = make_kv_event_source(config, kv)
    try:
        publisher = source.publisher
        for _ in range(200):  # faster than the thread can take them
            publisher.publish([AllBlocksCleared()])
        assert publisher.num_dropped > 0
        assert publisher.last_seq == 199  # dropped batches keep their numbers: a visible gap
    finally:
        source.close()


def test_a_busy_port_is_a_clear_start_up_error():
    with zmq.Context() as context, context.socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        config = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:%d"}' % port
        with pytest.raises(ValueError, match="cannot bind"):
            make_kv_event_source(config, KVCacheManager(num_blocks=4, block_size=BLOCK))


def test_kv_events_ports_are_taken_below_the_ephemeral_range_and_never_twice():
    """The server picks its publisher's ports before the engine core binds them: ports from
    the ephemeral range could go to any outgoing connection meanwhile (a CI run lost one)."""
    import json

    from kvserve.engine_config import EngineConfig
    from kvserve.kv_events import with_kv_events
    from kvserve.ports import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)] + [free_port("")]
    assert len(set(ports)) == len(ports)
    if low - 1024 >= 4096:  # Linux's default range leaves room below it
        assert all(port < low for port in ports)
    config = with_kv_events(EngineConfig(), "127.0.0.1")
    events = json.loads(config.kv_events_config)
    endpoints = {events["endpoint"], events["replay_endpoint"]}
    assert len(endpoints) == 2
    for endpoint in endpoints:
        with zmq.Context() as context, context.socket(zmq.PUB) as publisher:
            publisher.bind(endpoint)  # free when its owner comes to bind it
