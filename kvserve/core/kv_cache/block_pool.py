"""The block pool: fixed-size KV blocks, reference counts, a free queue in eviction order, and
the map from prefix hashes to cached blocks. Pure bookkeeping in block ids; no tensors.

Free queue order (front is evicted first): blocks that can never be reused (no hash) go to the
front; cached (hashed) blocks go to the back in the order they were freed, so the least recently
used cached block is evicted first.

Agent sessions (issue 34): a cached block freed with `pinned_until` (a request that named its
session) waits in a second queue that is evicted from only when the first is empty, until that
time passes or more than `max_pinned` blocks are pinned (the oldest then rejoin the first
queue at its front: they are old). A hit takes a block out of whichever queue holds it.

With KV events on (`enable_events`), caching, evicting and resetting are recorded as vLLM's
BlockStored / BlockRemoved / AllBlocksCleared (kvserve/kv_events.py) until `take_events`. With
`record_evictions` (a KV connector that wants them, e.g. an offload tier), each cached block
dropped, by reuse or by a reset, is kept as (hash, block id) until `take_evictions`.

KV cache groups (spec.py) share the pool: each group caches its blocks under its own map (one
prefix has one block per group), and only group 0's blocks are published as KV events and
evictions (the router and the connectors see one hash chain). With a sliding-window group the
pool keeps block 0 aside as the null block: a window table points its slid-out positions at it,
and the kernels never read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.protocol.worker import NULL_BLOCK_ID

BlockKey = tuple  # (parent_hash, token ids tuple, extra_keys)


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    block_key: BlockKey | None = None  # what was hashed, to confirm hits
    group: int = 0  # the KV cache group whose map caches it (while block_hash is set)
    pinned_until: float | None = None  # free and kept for its session until then
    prev: "KVBlock | None" = None
    next: "KVBlock | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle (a cache hit)."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev, block)

    def append_front(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def first(self) -> KVBlock:
        return self._head.next

    def pop_front(self) -> KVBlock:
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1,
                 reserve_null_block: bool = False):
        if num_blocks < 1 + reserve_null_block:
            raise ValueError("the KV pool needs at least one block"
                             + (" besides the null block" if reserve_null_block else ""))
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID] if reserve_null_block else None
        usable = [b for b in self.blocks if b is not self.null_block]
        self.num_usable_blocks = len(usable)
        self.free_queue = FreeBlockQueue(usable)
        self.pinned_queue = FreeBlockQueue([])  # free cached blocks of recent sessions
        self.max_pinned = 0  # blocks the pinned queue may hold (0: sessions pin nothing)
        self.clock = time.monotonic
        self.cached_by_group: list[dict[int, KVBlock]] = [{} for _ in range(num_groups)]
        self.cached = self.cached_by_group[0]  # group 0: the hashes published as KV events
        self.events: list | None = None  # None: KV events off, nothing recorded
        self.evictions: list[tuple[int, int]] | None = None  # None: nobody asked

    def enable_events(self) -> None:
        self.events = []

    def take_events(self) -> list:
        """The events since the last call (consecutive ones of a kind merged)."""
        events, self.events = self.events, []
        return events

    def record_evictions(self) -> None:
        self.evictions = []

    def take_evictions(self) -> list[tuple[int, int]]:
        """(block hash, block id) of each cached block dropped since the last call, in order;
        [] when not recording."""
        if not self.evictions:
            return []
        evictions, self.evictions = self.evictions, []
        return evictions

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.pinned_queue.num_free

    @property
    def num_pinned_blocks(self) -> int:
        return self.pinned_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the front of the free queue, evicting their cached contents."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} free")
        self._expire_pins()
        taken = []
        for _ in range(count):
            if self.free_queue.num_free:
                block = self.free_queue.pop_front()
            else:  # only pinned blocks are left: the oldest session's go first
                block = self.pinned_queue.pop_front()
                block.pinned_until = None
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: int, block_key: BlockKey, group: int = 0) -> KVBlock | None:
        """A cached block of `group` with this hash whose key matches exactly (no silent
        collisions)."""
        block = self.cached_by_group[group].get(block_hash)
        if block is None or block.block_key != block_key:
            return None
        return block

    def touch(self, block: KVBlock) -> None:
        """Take a reference on a (possibly free) cached block."""
        if block is self.null_block:
            return
        if block.ref_count == 0:
            if block.pinned_until is None:
                self.free_queue.remove(block)
            else:
                self.pinned_queue.remove(block)
                block.pinned_until = None
        block.ref_count += 1

    def free(self, blocks_tail_first: list[KVBlock], pinned_until: float | None = None) -> None:
        """Drop one reference from each block (the null block is never counted); cached ones
        that become free are kept for their session until `pinned_until` (a clock time) when
        given."""
        for block in blocks_tail_first:
            if block is self.null_block:
                continue
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} freed twice")
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.append_front(block)
                elif pinned_until is not None and self.max_pinned > 0:
                    block.pinned_until = pinned_until
                    self.pinned_queue.append(block)
                else:
                    self.free_queue.append(block)
        while self.pinned_queue.num_free > self.max_pinned:
            self._unpin(self.pinned_queue.pop_front())

    def _expire_pins(self) -> None:
        """Pins are kept in the order they were made, with one time to live: expired ones
        are at the front."""
        now = self.clock()
        while self.pinned_queue.num_free:
            oldest = self.pinned_queue.first()
            if oldest.pinned_until > now:
                return
            self.pinned_queue.remove(oldest)
            self._unpin(oldest)

    def _unpin(self, block: KVBlock) -> None:
        block.pinned_until = None
        self.free_queue.append_front(block)

    def cache(self, block: KVBlock, block_hash: int, block_key: BlockKey,
              group: int = 0) -> None:
        """Record a full, computed block of `group` under its prefix hash (first writer
        wins)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        cached = self.cached_by_group[group]
        if block_hash in cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash, block.block_key, block.group = block_hash, block_key, group
        cached[block_hash] = block
        if self.events is not None and group == 0:
            self._record_stored(block_hash, block_key)

    def _record_stored(self, block_hash: int, block_key: BlockKey) -> None:
        parent, tokens = block_key[0], block_key[1]
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)  # the next block of the same sequence
            last.token_ids.extend(tokens)
        else:
            self.events.append(BlockStored([block_hash], parent, list(tokens), len(tokens)))

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            cached = self.cached_by_group[block.group]
            if cached.get(block.block_hash) is block:
                del cached[block.block_hash]
                if self.evictions is not None and block.group == 0:
                    self.evictions.append((block.block_hash, block.block_id))
                if self.events is not None and block.group == 0:
                    last = self.events[-1] if self.events else None
                    if isinstance(last, BlockRemoved):
                        last.block_hashes.append(block.block_hash)
                    else:
                        self.events.append(BlockRemoved([block.block_hash]))
            block.block_hash = block.block_key = None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (only when no block is in use, as vLLM does)."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        if self.events is not None:
            self.events = [AllBlocksCleared()]  # supersedes what came before it
        return True
