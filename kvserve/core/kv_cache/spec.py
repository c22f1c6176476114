"""KV cache specs and groups: which layers share one block table, and what each kind of layer
keeps.

A `KVCacheSpec` says how a layer's KV grows with the sequence: full attention keeps every
token; a sliding window keeps only the last `sliding_window - 1` keys before the next query (the
kernels never read earlier ones). Layers with the same spec form a `KVCacheGroup`; each group has
its own block table per request, and every group allocates from the one block pool.

The engine builds the groups from the model's per-layer windows (`kv_cache_groups`). A model
that mixes full and windowed layers (Gemma 3: 5 windowed to 1 full) gets the hybrid layout, as
vLLM's hybrid allocator: the layers of each kind are cut into groups of one size G, every group
has its own block table per request, and the workers keep G KV tensors, tensor j shared by the
j-th layer of every group, so one block id from the pool addresses G layers' slots in whichever
group holds it (`layer_placement`). A windowed group then holds ~window / block_size blocks per
request, whatever its length. Where the kinds' layer counts do not divide into equal groups,
or with pipeline stages, the model runs as one full-attention group: its windowed layers still
attend only within their window (the kernels mask), they just keep all their KV.
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
class StreamingSpec(KVCacheSpec):
    """Attention sinks (StreamingLLM, an engine-wide opt-in): every layer keeps the request's
    first `sink_blocks` blocks and a recent window, so a sequence of any length holds a bounded
    number of blocks. Keys are rotated at their position *in the cache* (the paper's choice):
    the workers read the table with its evicted positions dropped, and when blocks are evicted
    they rotate the window's keys back by the evicted length (`ModelRunner`), as llama.cpp's
    context shift does.

    A query at position p sees the sinks and at least the `window` - 1 keys before it (the
    window slides in steps of `evict_blocks` blocks, so that each key is re-rotated a few times
    rather than once per block: every rotation rounds a bf16 key once more). Only the sink
    blocks are ever shared through the prefix cache: the window's keys change in place."""

    sink_blocks: int
    window: int
    evict_blocks: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.sink_blocks < 0 or self.evict_blocks < 1:
            raise ValueError(f"bad streaming KV policy: window {self.window}, sink blocks "
                             f"{self.sink_blocks}, eviction step {self.evict_blocks} blocks")

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first non-sink block the next query (at num_computed_tokens) reads."""
        return max(self.sink_blocks,
                   max(0, num_computed_tokens - self.window + 1) // self.block_size)

    def max_cached_tokens(self, chunk_tokens: int) -> int:
        """The most tokens a request's cache holds while `chunk_tokens` new ones are computed:
        sinks, the window rounded out to blocks, the eviction step and the chunk (the
        positions the keys are rotated at never reach this)."""
        window_blocks = -(-(self.window - 1) // self.block_size) + 1
        chunk_blocks = -(-chunk_tokens // self.block_size)
        return (self.sink_blocks + window_blocks + self.evict_blocks - 1 + chunk_blocks) \
            * self.block_size


def streaming_spec(block_size: int, window: int, sink_blocks: int) -> StreamingSpec:
    """The policy for `--streaming-window W` with `sink_blocks` blocks of sinks: the window
    slides a quarter at a time."""
    window_blocks = -(-window // block_size)
    return StreamingSpec(block_size, sink_blocks=sink_blocks, window=window,
                         evict_blocks=max(1, window_blocks // 4))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (their spec is the same)."""

    spec: KVCacheSpec
    layers: tuple[int, ...] = ()


def kv_cache_groups(sliding_windows: tuple[int | None, ...], num_layers: int,
                    block_size: int, hybrid: bool = True) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups for a model's per-layer windows (`ModelConfig.sliding_windows`; empty
    or all None: no windows). `hybrid` False: a mix of kinds runs as one full group."""
    windows = tuple(sliding_windows) or (None,) * num_layers
    layers = tuple(range(num_layers))
    kinds = set(windows)
    if kinds == {None}:
        return (KVCacheGroup(FullAttentionSpec(block_size), layers),)
    if len(kinds) == 1:
        (window,) = kinds
        return (KVCacheGroup(SlidingWindowSpec(block_size, window), layers),)
    by_kind = {kind: [i for i in layers if windows[i] == kind]
               for kind in sorted(kinds, key=lambda w: (w is not None, w or 0))}
    size = min(len(members) for members in by_kind.values())
    if not hybrid or any(len(members) % size for members in by_kind.values()):
        logger.info("KV cache: layers mix full attention and windows %s; all keep full KV (one "
                    "group): %s", sorted(w for w in kinds if w is not None),
                    "hybrid layout off" if not hybrid else "kinds do not split into equal groups")
        return (KVCacheGroup(FullAttentionSpec(block_size), layers),)
    groups = []
    for kind, members in by_kind.items():
        spec = FullAttentionSpec(block_size) if kind is None else \
            SlidingWindowSpec(block_size, kind)
        groups += [KVCacheGroup(spec, tuple(members[i:i + size]))
                   for i in range(0, len(members), size)]
    return tuple(groups)


def layer_placement(groups: tuple[KVCacheGroup, ...], num_layers: int,
                    ) -> tuple[list[int], list[int]]:
    """Per layer, its group and its KV tensor (its index within the group: the workers keep
    one tensor per index, shared by the groups). One group: every layer its own tensor."""
    group_of, tensor_of = [0] * num_layers, list(range(num_layers))
    if len(groups) > 1:
        for g, group in enumerate(groups):
            for j, layer in enumerate(group.layers):
                group_of[layer], tensor_of[layer] = g, j
    return group_of, tensor_of


def layers_per_block(groups: tuple[KVCacheGroup, ...], num_layers: int) -> int:
    """How many layers' slots one pool block spans: the group size in the hybrid layout, every
    layer with one group."""
    return len(groups[0].layers) if len(groups) > 1 else num_layers


def pool_token_capacity(num_blocks: int, groups: tuple[KVCacheGroup, ...],
                        chunk_tokens: int) -> int:
    """The longest sequence `num_blocks` blocks hold alone, computed in chunks of up to
    `chunk_tokens`: each window group holds at most a window's blocks plus a chunk's (every
    new token's KV is written before the window slides past it), the full groups share the
    rest."""
    block_size = groups[0].spec.block_size
    window_blocks = sum(-(-(group.spec.sliding_window - 1 + chunk_tokens) // block_size) + 1
                        for group in groups if isinstance(group.spec, SlidingWindowSpec))
    full_groups = sum(1 for group in groups if isinstance(group.spec, FullAttentionSpec))
    if not full_groups:
        return 2**31 - 1  # only windows: any length fits once the window's blocks do
    return max(0, num_blocks - window_blocks) // full_groups * block_size
