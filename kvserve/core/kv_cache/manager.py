"""KVCacheManager: which blocks each request owns, and automatic prefix caching.

It speaks block ids only. A full block is hashed (protocol/block_hash.py: chained to its parent
block's hash, equal across processes) once its tokens' KV is computed; a later request whose
prompt walks the same chain of hashes reuses those blocks. Rules learnt by other engines: a hit
never covers the whole prompt (one token is always computed, to produce logits), hits are
confirmed against the tokens, finished requests leave prompt *and* output blocks cached, and
blocks are freed tail first.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.kv_cache.block_pool import BlockKey, BlockPool, KVBlock
from kvserve.core.request import Request
from kvserve.protocol.block_hash import hash_block_tokens


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.stats = PrefixCacheStats()
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
        return [block.block_id for block in self.req_blocks.get(request_id, [])]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _block_key(self, request: Request, index: int) -> BlockKey:
        parent = request.block_hashes[index - 1] if index else None
        start = index * self.block_size
        return (parent, tuple(request.all_token_ids[start:start + self.block_size]), None)

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash every full block within the first num_tokens tokens not hashed yet (each block
        once per request: ~2 us, docs/performance.md)."""
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for index in range(len(hashes), num_tokens // size):
            hashes.append(hash_block_tokens(hashes[index - 1] if index else None,
                                            tokens[index * size:(index + 1) * size]))

    def num_cached_prefix_blocks(self, token_ids: list[int]) -> int:
        """How many leading full blocks of `token_ids` this pool holds cached (the ground
        truth a router's placement is measured against; read-only)."""
        if not self.enable_prefix_caching:
            return 0
        size, parent, count = self.block_size, None, 0
        while (count + 1) * size <= len(token_ids):
            tokens = tuple(token_ids[count * size:(count + 1) * size])
            block_hash = hash_block_tokens(parent, tokens)
            if self.pool.lookup(block_hash, (parent, tokens, None)) is None:
                break
            parent, count = block_hash, count + 1
        return count

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks matching the request's prefix, and how many tokens they cover.

        Capped so at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        self._extend_hashes(request, max_hit_tokens)
        hits: list[KVBlock] = []
        for index, block_hash in enumerate(request.block_hashes):
            if (index + 1) * self.block_size > max_hit_tokens:
                break
            block = self.pool.lookup(block_hash, self._block_key(request, index))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def is_computing_elsewhere(self, request: Request, num_hit_tokens: int) -> bool:
        """Is the block right after this request's hit being computed by another request?
        Then waiting one step costs less than computing the same prefix twice."""
        index = num_hit_tokens // self.block_size
        if not self.enable_prefix_caching or index >= len(request.block_hashes):
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

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was admitted (failed admissions are retried later)."""
        if self.enable_prefix_caching:
            self.stats.queries += num_query_tokens
            self.stats.hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens beyond the computed ones (after taking `computed_blocks`,
        a prefix hit, for a request with no blocks yet). False, changing nothing, if the pool
        cannot hold them."""
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        if computed_blocks and held:
            raise AssertionError("prefix hits are only taken by requests without blocks")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed_blocks)
        # free cached blocks we are about to touch are not available for allocation
        reusable_free = sum(1 for block in computed_blocks if block.ref_count == 0)
        if needed > self.pool.num_free_blocks - reusable_free:
            return False
        for block in computed_blocks:
            self.pool.touch(block)
        blocks = self.req_blocks.setdefault(request.request_id, held)
        blocks.extend(computed_blocks)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Hash and cache the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(request, request.num_computed_tokens)
        blocks = self.req_blocks.get(request.request_id, [])
        computed = min(request.num_computed_tokens // self.block_size, len(blocks))
        for index in range(computed):
            if blocks[index].block_hash is None:
                self.pool.cache(blocks[index], request.block_hashes[index],
                                self._block_key(request, index))
            if self.pending.get(request.block_hashes[index]) == request.request_id:
                del self.pending[request.block_hashes[index]]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so the tail is evicted before the prefix."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free(list(reversed(blocks)))
        self._clear_pending(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
