"""KVCacheManager: the coordinator of the KV cache groups, and automatic prefix caching.

It speaks block ids only. Every group (spec.py: full attention, a sliding window) has its own
block table per request, from the one block pool, managed by a per-type manager
(single_type.py); this class asks them all. A full block is hashed (protocol/block_hash.py:
chained to its parent block's hash, equal across processes) once its tokens' KV is computed; a
later request whose prompt walks the same chain of hashes reuses those blocks. Rules learnt by
other engines: a hit never covers the whole prompt (one token is always computed, to produce
logits), hits are confirmed against the tokens, a hit is a length every group can serve (the
groups' answers intersected), finished requests leave prompt *and* output blocks cached, and
blocks are freed tail first.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.kv_cache.block_pool import BlockKey, BlockPool, KVBlock
from kvserve.core.kv_cache.single_type import SingleTypeKVCacheManager, make_single_type_manager
from kvserve.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    StreamingSpec,
)
from kvserve.core.request import Request
from kvserve.protocol.block_hash import hash_block_tokens, salted_root

# a prefix hit: per group, the blocks its table starts with (the null block where a window
# group needs nothing)
ComputedBlocks = tuple[list[KVBlock], ...]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached
    session_queries: int = 0  # of the queries, those of requests that named a session
    session_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: tuple[KVCacheGroup, ...] | None = None):
        groups = groups or (KVCacheGroup(FullAttentionSpec(block_size)),)
        if any(group.spec.block_size != block_size for group in groups):
            raise ValueError("every KV cache group must use the engine's block size")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups
        self.pool = BlockPool(num_blocks, enable_prefix_caching, num_groups=len(groups),
                              reserve_null_block=any(
                                  isinstance(group.spec, (SlidingWindowSpec, StreamingSpec))
                                  for group in groups))
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(group.spec, self.pool, index)
            for index, group in enumerate(groups)]
        self.stats = PrefixCacheStats()
        self.session_ttl_s = 0.0  # how long a session's freed blocks stay pinned
        # full prompt blocks scheduled but not computed yet: hash -> the request computing it
        self.pending: dict[int, str] = {}
        self._pending_by_request: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, as the workers hold it (one group: the workers keep one
        table per request)."""
        if len(self.managers) != 1:
            raise NotImplementedError("the workers hold one block table per request; this "
                                      "engine has several KV cache groups")
        return self.managers[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in every group."""
        return [manager.block_ids(request_id) for manager in self.managers]

    def num_held_blocks(self, request_id: str) -> int:
        """Real blocks the request holds, all groups together."""
        return sum(manager.num_held_blocks(request_id) for manager in self.managers)

    # ---- prefix cache --------------------------------------------------------------------
    def _block_key(self, request: Request, index: int) -> BlockKey:
        parent = request.block_hashes[index - 1] if index else request.hash_root
        start = index * self.block_size
        return (parent, tuple(request.all_token_ids[start:start + self.block_size]), None)

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash every full block within the first num_tokens tokens not hashed yet (each block
        once per request: ~2 us, docs/performance-journal.md)."""
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for index in range(len(hashes), num_tokens // size):
            hashes.append(hash_block_tokens(hashes[index - 1] if index else request.hash_root,
                                            tokens[index * size:(index + 1) * size]))

    def num_cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None
                                 ) -> int:
        """How many leading full blocks of `token_ids` (under `cache_salt`) group 0 holds
        cached (the ground truth a router's placement is measured against; read-only)."""
        if not self.enable_prefix_caching:
            return 0
        size, parent, count = self.block_size, salted_root(cache_salt), 0
        while (count + 1) * size <= len(token_ids):
            tokens = tuple(token_ids[count * size:(count + 1) * size])
            block_hash = hash_block_tokens(parent, tokens)
            if self.pool.lookup(block_hash, (parent, tokens, None)) is None:
                break
            parent, count = block_hash, count + 1
        return count

    def _lookup(self, request: Request, group: int):
        """index -> the cached block of `group` holding the request's block there, or None;
        remembered, since the groups' answers and the hit's blocks ask for the same ones."""
        found: dict[int, KVBlock | None] = {}

        def lookup(index: int) -> KVBlock | None:
            if index not in found:
                found[index] = self.pool.lookup(request.block_hashes[index],
                                                self._block_key(request, index), group)
            return found[index]
        return lookup

    def _no_hit(self) -> ComputedBlocks:
        return tuple([] for _ in self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Cached blocks matching the request's prefix in every group, and how many tokens
        they cover: the longest length every group can serve (asked in turn until they agree;
        each answer is at most the one before). Capped so at least one token is left to
        compute."""
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return self._no_hit(), 0
        max_hit_tokens = request.num_tokens - 1
        self._extend_hashes(request, max_hit_tokens)
        lookups = [self._lookup(request, group) for group in range(len(self.managers))]
        hit = min(len(request.block_hashes), max_hit_tokens // self.block_size)
        # a group's answer is a fixed point for itself: stop once every group in a row has
        # answered the current length (one question when there is one group)
        agreed, turn = 0, 0
        while agreed < len(self.managers):
            group = turn % len(self.managers)
            answer = self.managers[group].longest_hit(lookups[group], hit)
            agreed = agreed + 1 if answer == hit else 1
            hit, turn = answer, turn + 1
        blocks = tuple(manager.hit_blocks(lookup, hit)
                       for manager, lookup in zip(self.managers, lookups))
        return blocks, hit * self.block_size

    def is_computing_elsewhere(self, request: Request, num_hit_tokens: int) -> bool:
        """Is the block right after this request's hit being computed by another request?
        Then waiting one step costs less than computing the same prefix twice."""
        index = num_hit_tokens // self.block_size
        if (not self.enable_prefix_caching or request.skips_prefix_cache
                or index >= len(request.block_hashes)):
            return False
        owner = self.pending.get(request.block_hashes[index])
        return owner is not None and owner != request.request_id

    def mark_pending(self, request: Request) -> None:
        """Announce the full blocks this newly admitted request will compute (hashed by
        `get_computed_blocks`), so identical prefixes arriving meanwhile wait for them."""
        if not self.enable_prefix_caching:
            return
        start = request.num_computed_tokens // self.block_size
        mine = self._pending_by_request.setdefault(request.request_id, [])
        for block_hash in request.block_hashes[start:]:
            if block_hash not in self.pending and block_hash not in self.pool.cached:
                self.pending[block_hash] = request.request_id
                mine.append(block_hash)

    def _clear_pending(self, request_id: str) -> None:
        hashes = self._pending_by_request.pop(request_id, [])
        for block_hash in hashes:
            if self.pending.get(block_hash) == request_id:
                del self.pending[block_hash]

    def pin_sessions(self, ttl_s: float, max_fraction: float) -> None:
        """Keep the freed blocks of requests that name a session (agents' next turns) for
        `ttl_s` seconds, evicting other blocks first, in at most `max_fraction` of the pool."""
        self.session_ttl_s = ttl_s if self.enable_prefix_caching else 0.0
        self.pool.max_pinned = int(max_fraction * self.pool.num_usable_blocks) \
            if self.session_ttl_s > 0 else 0

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int,
                             session: bool = False) -> None:
        """Count a lookup whose request was admitted (failed admissions are retried later)."""
        if self.enable_prefix_caching:
            self.stats.queries += num_query_tokens
            self.stats.hits += num_hit_tokens
            if session:
                self.stats.session_queries += num_query_tokens
                self.stats.session_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: ComputedBlocks | None = None) -> bool:
        """Make room for num_new_tokens beyond the computed ones (after taking `computed_blocks`,
        a prefix hit, for a request with no blocks yet). Window groups first release the
        blocks no query from here on reads, so the need counted is the real one. False,
        changing nothing else, if the pool cannot hold them."""
        computed_blocks = computed_blocks or self._no_hit()
        num_hit_blocks = len(computed_blocks[0])
        if num_hit_blocks and self.managers[0].blocks(request.request_id):
            raise AssertionError("prefix hits are only taken by requests without blocks")
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        for manager in self.managers:
            manager.release_unneeded(request.request_id, num_computed)
        total = num_computed + num_new_tokens
        needed = [manager.num_new_blocks(request.request_id, total, computed)
                  for manager, computed in zip(self.managers, computed_blocks)]
        # free cached blocks we are about to touch are not available for allocation
        reusable_free = sum(1 for computed in computed_blocks for block in computed
                            if block.ref_count == 0 and block is not self.pool.null_block)
        if sum(needed) > self.pool.num_free_blocks - reusable_free:
            return False
        for manager, computed, count in zip(self.managers, computed_blocks, needed):
            manager.take(request.request_id, computed, count)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Hash and cache the request's full blocks whose KV is now computed, in every group."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(request, request.num_computed_tokens)
        num_full = request.num_computed_tokens // self.block_size
        for group, manager in enumerate(self.managers):
            manager.cache_full_blocks(
                request.request_id, num_full,
                lambda block, index, group=group: self.pool.cache(
                    block, request.block_hashes[index], self._block_key(request, index), group))
        for block_hash in request.block_hashes[:num_full]:
            if self.pending.get(block_hash) == request.request_id:
                del self.pending[block_hash]

    def release_unneeded(self, request: Request) -> None:
        """Free the blocks no query from the request's next position on reads (window groups:
        those behind the window), right after a step, so the next step's admission and
        preemption count them as free. Cached ones stay cached until reused."""
        for manager in self.managers:
            manager.release_unneeded(request.request_id, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first, so the tail is evicted
        before the prefix."""
        pinned_until = (self.pool.clock() + self.session_ttl_s
                        if request.session_id and self.session_ttl_s > 0 else None)
        for manager in self.managers:
            manager.free(request.request_id, pinned_until)
        self._clear_pending(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
