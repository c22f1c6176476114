"""KVCacheManager and BlockPool on tiny pools: exact block ids, ref counts, hits, eviction."""

from __future__ import annotations

import pytest

from kvserve.core.kv_cache.manager import KVCacheManager
from tests.helpers import admit, make_request

BLOCK = 4


def test_allocation_takes_blocks_in_order_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", list(range(10)))  # 3 blocks: 2 full + 1 partial
    admit(kv, request)
    assert kv.block_ids("a") == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 1]
    assert kv.num_free_blocks == 5
    kv.free(request)
    # partial block 2 (unhashed) goes to the front: evicted first; cached 1 then 0 at the back
    assert kv.pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert all(kv.pool.blocks[i].ref_count == 0 for i in range(8))


def test_prefix_hit_reuses_blocks_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = make_request("a", list(range(10)))
    assert admit(kv, first) == 0
    second = make_request("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, second) == 8
    assert kv.block_ids("b")[:2] == [0, 1]
    assert kv.pool.blocks[0].ref_count == 2 and kv.pool.blocks[1].ref_count == 2
    assert kv.stats.queries == 21 and kv.stats.hits == 8


def test_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, make_request("a", list(range(8))))  # exactly 2 full blocks
    again = make_request("b", list(range(8)))
    blocks, hit = kv.get_computed_blocks(again)
    assert hit == 4 and [b.block_id for b in blocks[0]] == [0]  # last block recomputed


def test_blocks_hashed_only_after_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", list(range(8)))
    assert kv.allocate_slots(request, 8)
    assert kv.pool.cached == {}  # allocated but not computed
    request.num_computed_tokens = 5
    kv.cache_computed_blocks(request)
    assert len(kv.pool.cached) == 1  # only the first block is fully computed
    other = make_request("b", list(range(8)) + [1])
    assert kv.get_computed_blocks(other)[1] == 4


def test_finished_request_keeps_prompt_and_output_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, request)
    for token in (7, 8):  # two decode steps: output tokens fill block 1
        request.append_output_token(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        kv.cache_computed_blocks(request)
    kv.free(request)
    next_turn = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert admit(kv, next_turn) == 8


def test_eviction_takes_unhashed_then_least_recently_freed():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    old = make_request("old", list(range(100, 108)))  # blocks 0, 1 cached
    admit(kv, old)
    kv.free(old)
    new = make_request("new", list(range(200, 208)))  # blocks 2, 3 cached
    admit(kv, new)
    kv.free(new)
    # free queue: old's blocks (freed first) evicted first: 1 (tail) then 0, then 3, 2
    assert kv.pool.free_queue.block_ids() == [1, 0, 3, 2]
    big = make_request("big", list(range(300, 312)))  # needs 3 blocks
    assert kv.allocate_slots(big, 12)
    assert kv.block_ids("big") == [1, 0, 3]
    assert kv.get_computed_blocks(make_request("x", list(range(100, 108)) + [0]))[1] == 0
    assert kv.get_computed_blocks(make_request("y", list(range(200, 208)) + [0]))[1] == 4


def test_hash_collision_is_not_a_hit(monkeypatch):
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    victim = make_request("b", [9, 9, 9, 9, 5])
    # forge a collision: b's first block gets a's hash
    kv._extend_hashes(victim, 4)
    victim.block_hashes[0] = next(iter(kv.pool.cached))
    assert kv.get_computed_blocks(victim)[1] == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    request = make_request("a", list(range(16)))
    assert not kv.allocate_slots(request, 16)
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []


def test_cached_free_blocks_count_against_capacity():
    """Touching a free cached block removes it from the free queue: it cannot be double-counted."""
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    first = make_request("a", list(range(8)))
    admit(kv, first)
    kv.free(first)  # blocks 0, 1 cached and free; 2 free
    second = make_request("b", list(range(8)) + list(range(50, 58)))  # hit 8, needs 2 more
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8
    assert not kv.allocate_slots(second, 8, blocks)  # 2 cached in use + 2 new > 3
    assert kv.num_free_blocks == 3


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    admit(kv, make_request("a", list(range(10))))
    assert admit(kv, make_request("b", list(range(10)))) == 0
    assert kv.pool.cached == {} and kv.stats.queries == 0


def test_double_free_is_detected():
    from kvserve.core.kv_cache.block_pool import BlockPool

    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


# ---- agent sessions: freed blocks kept for the session's next turn ---------------------------
def _session_pool(ttl: float = 60.0, fraction: float = 0.5) -> tuple[KVCacheManager, list]:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    clock = [100.0]
    kv.pool.clock = lambda: clock[0]
    kv.pin_sessions(ttl, fraction)
    return kv, clock


def test_a_sessions_blocks_are_evicted_only_when_nothing_else_is_free():
    kv, _ = _session_pool()
    agent = make_request("agent", list(range(100, 108)))  # 2 blocks
    agent.session_id = "s1"
    admit(kv, agent)
    kv.free(agent)
    assert kv.pool.num_pinned_blocks == 2 and kv.num_free_blocks == 8
    plain = make_request("plain", list(range(200, 208)))
    admit(kv, plain)
    kv.free(plain)
    big = make_request("big", list(range(300, 324)))  # 6 blocks: every unpinned one
    assert kv.allocate_slots(big, 24)
    assert kv.get_computed_blocks(make_request("x", list(range(200, 208)) + [0]))[1] == 0
    next_turn = make_request("turn2", list(range(100, 108)) + [1, 2])
    next_turn.session_id = "s1"
    assert kv.get_computed_blocks(next_turn)[1] == 8  # the session's blocks survived
    kv.free(big)
    huge = make_request("huge", list(range(400, 432)))  # all 8: pinned ones go last
    assert kv.allocate_slots(huge, 32)
    assert kv.pool.num_pinned_blocks == 0


def test_pins_expire_and_never_exceed_their_share_of_the_pool():
    kv, clock = _session_pool(ttl=10.0, fraction=0.25)  # at most 2 of 8 blocks
    first = make_request("first", list(range(100, 108)))
    first.session_id = "s1"
    admit(kv, first)
    kv.free(first)
    second = make_request("second", list(range(200, 208)))
    second.session_id = "s2"
    admit(kv, second)
    kv.free(second)
    assert kv.pool.num_pinned_blocks == 2  # s1's blocks went back to the plain queue
    assert set(kv.pool.free_queue.block_ids()[:2]) == {0, 1}  # at its front: old
    clock[0] += 11
    assert kv.allocate_slots(make_request("c", list(range(8))), 4)
    assert kv.pool.num_pinned_blocks == 0  # s2's pins expired


def test_a_hit_takes_a_pinned_block_out_of_its_queue_and_sessions_are_counted():
    kv, _ = _session_pool()
    agent = make_request("agent", list(range(100, 109)))
    agent.session_id = "s1"
    admit(kv, agent)
    kv.free(agent)
    assert kv.pool.num_pinned_blocks == 2
    again = make_request("again", list(range(100, 109)))
    again.session_id = "s1"
    blocks, hit = kv.get_computed_blocks(again)
    assert kv.allocate_slots(again, again.num_tokens - hit, blocks)
    kv.record_prefix_lookup(again.num_tokens, hit, session=True)
    assert kv.pool.num_pinned_blocks == 0 and hit == 8
    assert (kv.stats.session_queries, kv.stats.session_hits) == (9, 8)
