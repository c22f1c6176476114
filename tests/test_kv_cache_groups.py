"""KV cache groups on tiny pools: specs, window tables, hits intersected across groups, exact
block counts (block size 4, window 8: a query reads at most ceil(7/4) = 2 earlier blocks)."""

from __future__ import annotations

import pytest

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    kv_cache_groups,
    layer_placement,
    layers_per_block,
)
from tests.helpers import admit, make_request

BLOCK, WINDOW = 4, 8
NULL = 0  # the pool keeps block 0 aside as the null block when a window group exists
FULL = KVCacheGroup(FullAttentionSpec(BLOCK), (0,))
SLIDING = KVCacheGroup(SlidingWindowSpec(BLOCK, WINDOW), (1,))


def _window_kv(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, groups=(SLIDING,))


def _decode(kv: KVCacheManager, request, token: int) -> None:
    """One decode step as the scheduler runs it: allocate, compute, cache, release."""
    request.append_output_token(token)
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    kv.cache_computed_blocks(request)
    kv.release_unneeded(request)


def test_spec_arithmetic():
    spec = SlidingWindowSpec(BLOCK, WINDOW)
    assert spec.blocks_before_query == 2
    # the query at position p reads keys p-7 .. p: the block of p-7 is the first one needed
    assert [spec.first_needed_block(p) for p in (0, 7, 10, 11, 13, 16, 20)] == \
        [0, 0, 0, 1, 1, 2, 3]
    assert SlidingWindowSpec(BLOCK, 1).blocks_before_query == 0
    with pytest.raises(ValueError):
        SlidingWindowSpec(BLOCK, 0)


def test_groups_from_model_windows():
    assert kv_cache_groups((), 2, BLOCK) == (KVCacheGroup(FullAttentionSpec(BLOCK), (0, 1)),)
    assert kv_cache_groups((None, None), 2, BLOCK)[0].spec == FullAttentionSpec(BLOCK)
    assert kv_cache_groups((64, 64), 2, BLOCK) == \
        (KVCacheGroup(SlidingWindowSpec(BLOCK, 64), (0, 1)),)
    # mixed: the hybrid layout, groups of one size (the smaller kind's count), full first
    full, window = FullAttentionSpec(BLOCK), SlidingWindowSpec(BLOCK, 64)
    assert kv_cache_groups((None, 64, 64), 3, BLOCK) == (
        KVCacheGroup(full, (0,)), KVCacheGroup(window, (1,)), KVCacheGroup(window, (2,)))
    gemma3 = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    groups = kv_cache_groups(gemma3, 18, BLOCK)
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9),
                                          (10, 12, 13), (14, 15, 16)]
    assert layer_placement(groups, 18)[0] == [1, 1, 1, 2, 2, 0, 2, 3, 3, 3, 4, 0, 4, 4, 5, 5, 5,
                                              0]
    assert layer_placement(groups, 18)[1][:6] == [0, 1, 2, 0, 1, 0]
    assert layers_per_block(groups, 18) == 3
    # counts that do not split into equal groups (2 full, 3 windowed), or the layout off:
    # one full group (the kernels still mask each window)
    for windows, hybrid in (((None, 64, 64, None, 64), True), ((None, 64, 64), False)):
        assert kv_cache_groups(windows, len(windows), BLOCK, hybrid) == \
            (KVCacheGroup(full, tuple(range(len(windows)))),)


def test_null_block_is_kept_aside_only_with_a_window_group():
    assert KVCacheManager(8, BLOCK).pool.null_block is None
    kv = _window_kv(8)
    assert kv.pool.null_block.block_id == NULL
    assert kv.num_free_blocks == 7 and kv.pool.num_usable_blocks == 7
    assert NULL not in kv.pool.free_queue.block_ids()


def test_window_blocks_are_released_as_they_slide_out():
    kv = _window_kv(16)
    request = make_request("a", list(range(20)))  # 5 full blocks, one prefill step
    admit(kv, request)
    assert kv.block_ids("a") == [1, 2, 3, 4, 5] and kv.num_free_blocks == 10
    _decode(kv, request, 100)  # the query at 20 reads 13..20: blocks 0-2 slide out
    assert kv.block_ids("a") == [NULL, NULL, NULL, 4, 5, 6]
    assert kv.num_held_blocks("a") == 3 and kv.num_free_blocks == 12
    # released blocks stay cached (computed, hashed) at the back of the free queue
    assert kv.pool.free_queue.block_ids()[-3:] == [3, 2, 1]
    assert all(kv.pool.blocks[i].block_hash is not None for i in (1, 2, 3))


def test_window_kv_per_request_is_bounded():
    kv = _window_kv(16)
    request = make_request("a", list(range(20)), max_tokens=200)
    admit(kv, request)
    held = []
    for step in range(100):
        _decode(kv, request, 1000 + step)
        held.append(kv.num_held_blocks("a"))
    # blocks of positions p-7 .. p: 3 when the window straddles three blocks, else 2
    assert max(held) == 3 and min(held) == 2
    assert kv.num_free_blocks == 15 - held[-1]
    kv.free(request)
    assert kv.num_free_blocks == 15


def test_admission_counts_the_window_need():
    """Five usable blocks, all held by a 20-token prompt: its next token needs a sixth block,
    which fits only because three blocks slide out first."""
    kv = _window_kv(6)
    request = make_request("a", list(range(20)))
    admit(kv, request)
    assert kv.num_free_blocks == 0
    _decode(kv, request, 100)
    assert kv.num_free_blocks == 2 and kv.num_held_blocks("a") == 3
    full = KVCacheManager(5, BLOCK)
    other = make_request("b", list(range(20)))
    admit(full, other)
    other.append_output_token(100)
    assert not full.allocate_slots(other, 1)  # full attention really needs the sixth


def _forget(kv: KVCacheManager, block_hash: int, group: int = 0) -> None:
    """Drop one cached block from a group's map, as an eviction would."""
    block = kv.pool.cached_by_group[group].pop(block_hash)
    block.block_hash = block.block_key = None


def test_a_window_hit_needs_only_the_window_blocks():
    kv = _window_kv(16)
    first = make_request("a", list(range(16)) + [50, 51, 52, 53])
    admit(kv, first)
    kv.free(first)
    for index in (0, 1):
        _forget(kv, first.block_hashes[index])
    second = make_request("b", list(range(16)) + [60, 61, 62, 63, 64])
    blocks, hit = kv.get_computed_blocks(second)
    # blocks 2 and 3 cached: the query at 16 reads 9..16, nothing before block 2
    assert hit == 16
    assert [b.block_id for b in blocks[0]] == [NULL, NULL, 3, 4]
    assert kv.num_free_blocks == 15
    assert kv.allocate_slots(second, 5, blocks)
    # took the two cached blocks back from the free queue, and two new ones for 16..20
    assert kv.num_held_blocks("b") == 4 and kv.num_free_blocks == 11
    assert kv.block_ids("b")[:4] == [NULL, NULL, 3, 4]
    # full attention, missing block 0, has no hit at all
    full = KVCacheManager(16, BLOCK)
    admit(full, again := make_request("a", list(range(16)) + [50, 51, 52, 53]))
    full.free(again)
    _forget(full, again.block_hashes[0])
    assert full.get_computed_blocks(make_request("b", list(range(16)) + [60]))[1] == 0


def test_window_hit_scans_back_past_a_gap():
    kv = _window_kv(16)
    first = make_request("a", list(range(24)) + [1])
    admit(kv, first)
    kv.free(first)
    _forget(kv, first.block_hashes[4])  # positions 16..19 gone
    second = make_request("b", list(range(24)) + [2])
    # 6 blocks could hit; block 4 is missing, block 5 alone is not a window: scan back to
    # blocks 2-3, so the hit ends at block 4 (16 tokens)
    assert kv.get_computed_blocks(second)[1] == 16


def test_hits_are_intersected_across_groups():
    kv = KVCacheManager(32, BLOCK, groups=(FULL, SLIDING))
    first = make_request("a", list(range(20)), max_tokens=8)
    admit(kv, first)
    assert kv.num_free_blocks == 31 - 10  # one table per group: 5 blocks each
    for token in range(4):
        _decode(kv, first, 100 + token)
    full_ids, window_ids = kv.group_block_ids("a")
    assert len(full_ids) == 6 and window_ids[:3] == [NULL] * 3 and NULL not in full_ids
    kv.free(first)
    with pytest.raises(NotImplementedError):
        kv.block_ids("a")  # the workers hold one table per request
    prompt = list(range(20)) + [100, 101, 102, 103, 7]
    blocks, hit = kv.get_computed_blocks(make_request("b", prompt))
    assert hit == 24  # both groups serve 6 blocks
    assert len(blocks[0]) == 6 and [b.block_id for b in blocks[1][:4]] == [NULL] * 4
    # the window group lost block 5: it scans back to blocks 3-4 -> 5 blocks; full agrees
    hashes = make_request("h", prompt)
    kv._extend_hashes(hashes, 24)
    _forget(kv, hashes.block_hashes[5], group=1)
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == 20
    # the full group lost block 1: the window group must stop there too
    _forget(kv, hashes.block_hashes[1], group=0)
    blocks, hit = kv.get_computed_blocks(make_request("d", prompt))
    assert hit == 4 and [len(group) for group in blocks] == [1, 1]
    assert blocks[1][0].block_id != NULL  # block 0 is read by the query at 4


def test_only_group_zero_is_published_as_events():
    kv = KVCacheManager(32, BLOCK, groups=(FULL, SLIDING))
    kv.pool.enable_events()
    admit(kv, make_request("a", list(range(8)) + [1]))
    events = kv.pool.take_events()
    assert len(events) == 1 and len(events[0].block_hashes) == 2
    assert len(kv.pool.cached_by_group[1]) == 2


def test_gemma3_kv_per_request_at_8k_is_a_fifth_of_a_full_cache():
    """Gemma 3 270M's layout (15 layers windowed at 512, 3 full; block 16): an 8,192-token
    request holds exactly 512 blocks in the full group and, once decoding, 33 or 32 in each
    windowed one (positions p-511..p straddle 33 blocks but at a boundary), each block 3 layers'
    slots: ~1/6 + 5/6 x 512/8192 of the 18-layer full cache it would otherwise hold."""
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    groups = kv_cache_groups(windows, 18, 16)
    kv = KVCacheManager(4096, 16, groups=groups)
    request = make_request("a", list(range(8192)), max_tokens=64)
    admit(kv, request)
    kv.release_unneeded(request)
    per_group = [len([b for b in table if b != NULL]) for table in kv.group_block_ids("a")]
    # the prompt's last query (8191) reads 7680..8191: blocks 480..511
    assert per_group == [512] + [32] * 5
    for step in range(40):
        _decode(kv, request, step)
        held = [len([b for b in table if b != NULL]) for table in kv.group_block_ids("a")]
        assert held[0] == -(-request.num_tokens // 16) and all(h in (32, 33) for h in held[1:])
    layer_slots = kv.num_held_blocks("a") * layers_per_block(groups, 18)
    full_cache_slots = -(-request.num_tokens // 16) * 18
    expected = 1 / 6 + 5 / 6 * 512 / request.num_tokens
    assert abs(layer_slots / full_cache_slots - expected) < 0.01
