"""The `paged` attention backend: fused per-layer ops (compiled CPU kernels, or their torch
reference versions) and attention that reads K/V blocks in place.

Rows are split once per step. In bfloat16 with the compiled kernels, sequences with at least
FLASH_MIN_QUERY_LEN new tokens (prompts, chunks over a cached prefix) take the tiled flash kernel
(bf16 dot-product instructions, online softmax, any length) and the rest (decodes, very short
chunks) the paged kernel; both read K/V blocks in place. Otherwise (float32, the torch reference
ops): sequences with up to 128 new tokens go to the paged kernel; longer fresh prompts use SDPA's
tiled causal kernel on their own K/V; longer chunks on top of cached context gather their blocks
once and use SDPA. A layer's sliding window goes to every path (kernels: keys outside it are
skipped, blocks wholly before it never read; SDPA: a banded mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.heads import split_heads
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.reference import (as_stored, attend_fresh, dequantize_kv_rows,
                                       is_row_quantized, plain_scores)
from kvserve.kernels.reference import paged_attention_ as gathered_attention_

# Sequences with up to this many new tokens take the paged kernel: measured ~2x faster than
# gather + masked SDPA for 32-128-token chunks over 300-4,000 cached tokens; longer chunks gather
# (the kernel keeps a float score row per query head and key: 3 x 128 x 8,192 x 4 B = 12 MB).
MAX_PAGED_QUERY_LEN = 128
# Sequences with at least this many new tokens take the flash kernel when it can run: measured
# faster than the paged kernel from 4 new tokens (2x at 64 over 1,024 cached) and 3-4x faster
# than SDPA on fresh prompts (docs/performance-journal.md); decodes stay on the paged kernel.
FLASH_MIN_QUERY_LEN = 4


@dataclass
class StepPlan:
    paged_seq_ids: torch.Tensor  # int32: sequences for the paged kernel
    flash_seq_ids: torch.Tensor  # int32: sequences for the flash kernel
    query_start_loc: torch.Tensor  # int64 copy of metadata.query_start_loc
    fresh: list[int]  # sequences with no cached context and many tokens: plain causal SDPA
    gathered: list[int]  # long chunks over cached context: gather + SDPA


def plan_step(metadata: AttentionMetadata, use_flash: bool = False,
              flash_min_query_len: int = FLASH_MIN_QUERY_LEN) -> StepPlan:
    """Which path each sequence takes (computed once per step, reused by every layer)."""
    if metadata.plan is not None:
        return metadata.plan
    starts, seq_lens = metadata.query_start_loc_host, metadata.seq_lens_host
    paged, flash, fresh, gathered = [], [], [], []
    for i in range(metadata.num_seqs):
        query_len = starts[i + 1] - starts[i]
        if use_flash and query_len >= flash_min_query_len:
            flash.append(i)
        elif query_len <= MAX_PAGED_QUERY_LEN:
            paged.append(i)
        elif query_len == seq_lens[i]:
            fresh.append(i)
        else:
            gathered.append(i)
    metadata.plan = StepPlan(torch.tensor(paged, dtype=torch.int32),
                             torch.tensor(flash, dtype=torch.int32),
                             metadata.query_start_loc.long(), fresh, gathered)
    return metadata.plan


class PagedBackend:
    name = "paged"
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True

    def __init__(self, ops):
        self.ops = ops

    def attend(self, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
               sliding_window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D], rotated, its K/V already in the cache -> [T, H * D].
        sliding_window > 0: each query sees the keys less than that many positions back.
        softcap > 0 (Gemma 2): scores soft-capped, by the paged kernel (the flash kernel has no
        capping: such models never plan it). sinks (gpt-oss): each head's learned logit joins
        its softmax, likewise by the paged kernel."""
        plan = metadata.plan  # the first layer of a step plans it; the rest reuse it
        if plan is None:  # the torch reference ops report no flash kernel
            plan = plan_step(metadata, qkv.dtype == torch.bfloat16
                             and plain_scores(softcap, sinks)
                             and self.ops.flash_attention_supported(head_dim))
        out = torch.empty(qkv.shape[0], num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
        for kernel, seq_ids in ((self.ops.paged_attention_, plan.paged_seq_ids),
                                (self.ops.flash_attention_, plan.flash_seq_ids)):
            if not seq_ids.numel():
                continue
            cache, tables = kv_cache, metadata.block_tables
            if kernel is self.ops.flash_attention_ and is_row_quantized(kv_cache.dtype):
                cache, tables = dequantized_blocks(kv_cache, metadata, seq_ids, qkv.dtype)
            extra = {} if sinks is None else {"sinks": sinks}  # the flash kernel has none
            kernel(qkv, cache, out, seq_ids, plan.query_start_loc, metadata.seq_lens, tables,
                   num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap, **extra)
        starts = metadata.query_start_loc_host
        for i in plan.fresh:
            start, end = starts[i], starts[i + 1]
            query, key, value = (part.transpose(0, 1) for part in split_heads(
                qkv[start:end], num_heads, num_kv_heads, head_dim))
            # attend over the K/V as stored, as every other path
            key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
            attended = attend_fresh(query, key, value, scale, sliding_window, softcap, sinks)
            out[start:end] = attended.transpose(0, 1).reshape(end - start, -1)
        if plan.gathered:
            ids = torch.tensor(plan.gathered, dtype=torch.int32)
            gathered_attention_(qkv, kv_cache, out, ids, plan.query_start_loc, metadata.seq_lens,
                                metadata.block_tables, num_heads, num_kv_heads, head_dim, scale,
                                sliding_window, softcap, sinks)
        return out


def dequantized_blocks(kv_cache: torch.Tensor, metadata: AttentionMetadata,
                       seq_ids: torch.Tensor, dtype: torch.dtype):
    """The blocks of the sequences in seq_ids, dequantized from an int8 or fp8 cache into a dense
    [2, n * width, block_size, KVH, D] tensor of dtype, and block tables [num_seqs, width] into
    it (rows of other sequences zero). The flash kernel reads bf16 blocks; a prompt chunk's
    attention is compute-bound, so one pass over its context's codes costs little beside it.
    Table entries past a sequence's last block are never read (they are clamped to a real id)."""
    block_size = metadata.block_size
    seq_lens = metadata.seq_lens_host
    ids = seq_ids.tolist()
    width = max((seq_lens[i] + block_size - 1) // block_size for i in ids)
    tables = metadata.block_tables[seq_ids.long(), :width].long()
    tables = tables.clamp_(0, kv_cache.shape[1] - 1).flatten()
    dense = dequantize_kv_rows(kv_cache.index_select(1, tables), dtype)
    local = torch.zeros(metadata.num_seqs, width, dtype=torch.int32)
    local[seq_ids.long()] = torch.arange(len(ids) * width, dtype=torch.int32).view(len(ids), width)
    return dense, local
