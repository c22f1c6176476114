"""Attention sinks on the worker side: a streaming request's table with its evicted positions
dropped, and the window's keys rotated back when blocks are evicted.

The scheduler's policy (core/kv_cache/spec.py `StreamingSpec`) evicts the window's oldest blocks
by turning their table positions into the null block. Positions then count within the cache, as
StreamingLLM does: the cache is an ordinary sequence of sinks followed by the window, so every
attention kernel reads it unchanged. Keys were rotated at their cache position when written, so
after an eviction of E tokens the window's keys are rotated back by E (llama.cpp's context shift
does the same); the sink blocks never move, which is why they alone may be shared.
"""

from __future__ import annotations

from kvserve.protocol.worker import NULL_BLOCK_ID
from kvserve.worker.request_state import CachedRequestState


class StreamingKV:
    def __init__(self, model, block_size: int, sink_blocks: int):
        self.model = model
        self.block_size = block_size
        self.sink_blocks = sink_blocks

    def view(self, request: CachedRequestState, table: list[int],
             start_position: int) -> tuple[list[int], int]:
        """The request's cache table and where its new tokens start in it, after rotating
        the window's keys for any eviction since they were written (`request.kv_shift`: the
        evicted length they are rotated for). A restarted request's first step holds no window
        keys yet (only sinks can be prefix hits), so there is nothing to rotate then."""
        cache = [block for block in table if block != NULL_BLOCK_ID]
        evicted = (len(table) - len(cache)) * self.block_size
        start = start_position - evicted
        if evicted != request.kv_shift and start > self.sink_blocks * self.block_size:
            window = cache[self.sink_blocks:-(-start // self.block_size)]  # computed keys
            self.model.shift_keys(window, request.kv_shift - evicted)
        request.kv_shift = evicted
        return cache, start
