"""One manager per KV cache group: the blocks each request holds in that group's table, what a
prefix hit is for that kind of layer, and which blocks it no longer needs.

Both kinds share the block pool; the coordinator (manager.py) asks each group in turn. A full-
attention group needs every block of a hit and keeps every block it computed. A sliding-window
group needs only the blocks the next query's window reads: a hit is the longest prefix whose
last `blocks_before_query` blocks are cached (earlier positions point at the pool's null
block), and blocks that slide out of the window are freed as the request advances (they stay
in the prefix cache until their block is reused, so another request can still hit them).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.core.kv_cache.block_pool import BlockPool, KVBlock
from kvserve.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StreamingSpec,
)

# (block index) -> the cached block of this group holding the request's block there, or None
CachedLookup = Callable[[int], "KVBlock | None"]


class SingleTypeKVCacheManager:
    """The block tables of one group. Positions are kept even when a block is released (they
    then hold the null block), so table index i always covers tokens [i*bs, (i+1)*bs)."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group: int):
        self.spec = spec
        self.pool = pool
        self.group = group
        self.req_blocks: dict[str, list[KVBlock]] = {}

    # ---- queries -------------------------------------------------------------------------
    def blocks(self, request_id: str) -> list[KVBlock]:
        return self.req_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.blocks(request_id)]

    def num_held_blocks(self, request_id: str) -> int:
        """Real blocks the request holds in this group (null positions not counted)."""
        return sum(1 for block in self.blocks(request_id) if block is not self.pool.null_block)

    # ---- prefix hits ---------------------------------------------------------------------
    def longest_hit(self, lookup: CachedLookup, max_blocks: int) -> int:
        """The most leading blocks (<= max_blocks) this group can serve from the cache."""
        raise NotImplementedError

    def hit_blocks(self, lookup: CachedLookup, num_blocks: int) -> list[KVBlock]:
        """The table for a hit of `num_blocks` blocks (a length `longest_hit` allowed)."""
        raise NotImplementedError

    # ---- allocation ----------------------------------------------------------------------
    def release_unneeded(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no query from `num_computed_tokens` on reads (none for full
        attention)."""

    def num_new_blocks(self, request_id: str, num_tokens: int,
                       computed: list[KVBlock]) -> int:
        """Blocks to take from the pool so the table covers `num_tokens` tokens, after
        `computed` (a hit, for a request with no table yet) is taken."""
        return max(0, self.spec.blocks_for(num_tokens) - len(self.blocks(request_id))
                   - len(computed))

    def take(self, request_id: str, computed: list[KVBlock], num_new: int) -> None:
        """Append the hit's blocks (referenced) and `num_new` fresh ones to the table."""
        for block in computed:
            self.pool.touch(block)
        table = self.req_blocks.setdefault(request_id, [])
        table.extend(computed)
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))

    def cache_full_blocks(self, request_id: str, num_full_blocks: int,
                          cache_one: Callable[[KVBlock, int], None]) -> None:
        """Cache the request's first `num_full_blocks` real blocks not cached yet."""
        for index, block in enumerate(self.blocks(request_id)[:num_full_blocks]):
            if block.block_hash is None and block is not self.pool.null_block:
                cache_one(block, index)

    def free(self, request_id: str, pinned_until: float | None = None) -> None:
        """Release the table tail first, so the tail is evicted before the prefix (kept for
        the request's session until `pinned_until`, when given)."""
        self.pool.free(list(reversed(self.req_blocks.pop(request_id, []))), pinned_until)


class FullAttentionManager(SingleTypeKVCacheManager):
    def longest_hit(self, lookup: CachedLookup, max_blocks: int) -> int:
        count = 0
        while count < max_blocks and lookup(count) is not None:
            count += 1
        return count

    def hit_blocks(self, lookup: CachedLookup, num_blocks: int) -> list[KVBlock]:
        return [lookup(index) for index in range(num_blocks)]


class SlidingWindowManager(SingleTypeKVCacheManager):
    spec: SlidingWindowSpec

    def longest_hit(self, lookup: CachedLookup, max_blocks: int) -> int:
        """Scan back from max_blocks for a run of `blocks_before_query` cached blocks (or a
        shorter run reaching block 0): the hit ends where that run ends. Not monotone, unlike
        full attention: a shorter prefix may miss where a longer one hits."""
        needed, run = self.spec.blocks_before_query, 0
        if needed == 0:  # a window of one token reads no earlier key
            return max_blocks
        for index in range(max_blocks - 1, -1, -1):
            if lookup(index) is None:
                run = 0
                continue
            run += 1
            if run >= needed:
                return index + needed
        return run  # blocks 0 .. run-1 are cached, and nothing before them is read

    def hit_blocks(self, lookup: CachedLookup, num_blocks: int) -> list[KVBlock]:
        first = max(0, num_blocks - self.spec.blocks_before_query)
        return [self.pool.null_block] * first + [lookup(i) for i in range(first, num_blocks)]

    def release_unneeded(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.req_blocks.get(request_id)
        if not table:
            return
        # released positions form a prefix of the table: walk back from the first block still
        # needed to the last one released, so a step costs only what it releases
        null = self.pool.null_block
        released = []
        index = min(self.spec.first_needed_block(num_computed_tokens), len(table)) - 1
        while index >= 0 and table[index] is not null:
            released.append(table[index])
            table[index] = null
            index -= 1
        self.pool.free(released)


class StreamingManager(SingleTypeKVCacheManager):
    """Attention sinks: the sink blocks stay, the window's oldest blocks are evicted
    `evict_blocks` at a time (their table positions turn into the null block, as a window's
    do), and only sink blocks enter or come from the prefix cache (the workers rotate the
    window's keys in place when blocks are evicted, so no other request may share them)."""

    spec: StreamingSpec

    def longest_hit(self, lookup: CachedLookup, max_blocks: int) -> int:
        count, limit = 0, min(max_blocks, self.spec.sink_blocks)
        while count < limit and lookup(count) is not None:
            count += 1
        return count

    def hit_blocks(self, lookup: CachedLookup, num_blocks: int) -> list[KVBlock]:
        return [lookup(index) for index in range(num_blocks)]

    def cache_full_blocks(self, request_id: str, num_full_blocks: int,
                          cache_one: Callable[[KVBlock, int], None]) -> None:
        super().cache_full_blocks(request_id, min(num_full_blocks, self.spec.sink_blocks),
                                  cache_one)

    def release_unneeded(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.req_blocks.get(request_id)
        if not table:
            return
        null, sinks = self.pool.null_block, self.spec.sink_blocks
        end = min(self.spec.first_needed_block(num_computed_tokens), len(table))
        start = end  # evicted positions follow the sinks: walk back to the last one evicted
        while start > sinks and table[start - 1] is not null:
            start -= 1
        if end - start < self.spec.evict_blocks:
            return
        released = table[start:end]
        table[start:end] = [null] * (end - start)
        self.pool.free(list(reversed(released)))


def make_single_type_manager(spec: KVCacheSpec, pool: BlockPool,
                             group: int) -> SingleTypeKVCacheManager:
    if isinstance(spec, StreamingSpec):
        return StreamingManager(spec, pool, group)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, pool, group)
    raise ValueError(f"no KV cache manager for {type(spec).__name__}")
