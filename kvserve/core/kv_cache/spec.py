"""KV cache specs and groups: which layers share one block table, and what each kind of layer
keeps.

A `KVCacheSpec` says how a layer's KV grows with the sequence: full attention keeps every
token; a sliding window keeps only the last `sliding_window - 1` keys before the next query (the
kernels never read earlier ones). Layers with the same spec form a `KVCacheGroup`; each group has
its own block table per request, and every group allocates from the one block pool.

The engine builds the groups from the model's per-layer windows (`kv_cache_groups`). Until the
workers hold one block table per group (the hybrid layout, where a block id addresses the same
slot in one layer of every group), a model that mixes full and windowed layers runs as one
full-attention group: its windowed layers still attend only within their window (the kernels
mask), they just keep all their KV, as vLLM does with its hybrid manager disabled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """How one kind of layer keeps its KV, in blocks of `block_size` tokens."""

    block_size: int

    def blocks_for(self, num_tokens: int) -> int:
        """Table length that covers positions [0, num_tokens)."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token's KV is kept: a table of ceil(tokens / block_size) real blocks."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A query at position p reads keys p - sliding_window < k <= p (HF's and our kernels'
    convention), so blocks wholly before the next query's window are never read again."""

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def blocks_before_query(self) -> int:
        """Cached blocks a query at a block boundary reads: its window's sliding_window - 1
        earlier keys, rounded up to blocks (what a prefix hit needs)."""
        return -(-(self.sliding_window - 1) // self.block_size)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the next query (at position num_computed_tokens) reads."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (their spec is the same)."""

    spec: KVCacheSpec
    layers: tuple[int, ...] = ()


def kv_cache_groups(sliding_windows: tuple[int | None, ...], num_layers: int,
                    block_size: int) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups for a model's per-layer windows (`ModelConfig.sliding_windows`; empty
    or all None: no windows)."""
    windows = tuple(sliding_windows) or (None,) * num_layers
    layers = tuple(range(num_layers))
    kinds = set(windows)
    if kinds == {None}:
        return (KVCacheGroup(FullAttentionSpec(block_size), layers),)
    if len(kinds) == 1:
        (window,) = kinds
        return (KVCacheGroup(SlidingWindowSpec(block_size, window), layers),)
    logger.info("KV cache: layers mix full attention and windows %s; all keep full KV (one "
                "group) until the workers hold one block table per group",
                sorted(w for w in kinds if w is not None))
    return (KVCacheGroup(FullAttentionSpec(block_size), layers),)
