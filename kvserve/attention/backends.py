"""Attention backends, chosen by name. Each attends every new query token to its sequence's
cached K/V (causally), once the layer's op set has rotated Q and K and written the new K/V into
the paged cache (`rope_and_cache_`), and names the op set its model's layers run (`ops`).

`torch_ref` is the plain, clearly correct reference: it gathers each sequence's blocks and calls
SDPA. Fast backends must match it (tests/test_model_paged.py). A layer with a sliding window
passes it on each call; a backend that can honour windows says so with
`supports_sliding_window` (models with windowed layers refuse to load on any other), and one
that soft-caps scores (Gemma 2's `softcap`) with `supports_softcap`, and one that adds learned
per-head sink logits to the softmax (gpt-oss's `sinks`) with `supports_sinks`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from kvserve.attention.heads import split_heads
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.reference import (as_stored, attend_fresh, attend_gathered, first_visible_key,
                                       kv_as)


class AttentionBackend(Protocol):
    name: str
    supports_sliding_window: bool
    supports_softcap: bool
    supports_sinks: bool
    ops: object  # the op set the model's layers run with this backend (kvserve.kernels)

    def attend(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]: Q and K rotated, K/V already in the cache
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row]
        metadata: AttentionMetadata,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = 0,  # > 0: keys with query position - key position < it
        softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap)
        sinks: torch.Tensor | None = None,  # float32 [H]: each head's sink logit (gpt-oss)
    ) -> torch.Tensor:  # [T, H * D]
        ...


class TorchReferenceBackend:
    """One SDPA call per sequence over its gathered blocks; slow and obviously right. Its layers
    run on the torch reference ops."""

    name = "torch_ref"
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True

    def __init__(self):
        from kvserve.kernels import get_ops

        self.ops = get_ops(False)

    def attend(self, qkv, kv_cache, metadata, num_heads, num_kv_heads, head_dim, scale,
               sliding_window=0, softcap=0.0, sinks=None):
        query = split_heads(qkv, num_heads, num_kv_heads, head_dim)[0]
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        for i in range(metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            output[start:end] = _attend_one_gathered(query[start:end], kv_cache, metadata, i,
                                                     scale, sliding_window, softcap, sinks)
        return output.view(qkv.shape[0], -1)


class BatchedSDPABackend:
    """Fewer, larger SDPA calls: all decode rows (one query token each) in one padded call over
    their gathered blocks; prompts with no cached context attend to their own fresh K/V without
    reading the cache; only chunked/prefix-hit prompts gather per sequence, as the reference
    does. Same maths as `torch_ref`, far less Python per step (torch reference ops)."""

    name = "sdpa_batched"
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True

    def __init__(self):
        from kvserve.kernels import get_ops

        self.ops = get_ops(False)

    def attend(self, qkv, kv_cache, metadata, num_heads, num_kv_heads, head_dim, scale,
               sliding_window=0, softcap=0.0, sinks=None):
        query, key, value = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        decode_rows, other_rows = [], []
        for i in range(metadata.num_seqs):
            (decode_rows if starts[i + 1] - starts[i] == 1 else other_rows).append(i)
        if decode_rows:
            self._decode(query, kv_cache, metadata, decode_rows, scale, output, sliding_window,
                         softcap, sinks)
        for i in other_rows:
            start, end = starts[i], starts[i + 1]
            seq_len = metadata.seq_lens_host[i]
            if seq_len == end - start:  # nothing cached before: attention over its own K/V
                attended = attend_fresh(query[start:end].transpose(0, 1),
                                        as_stored(key[start:end], kv_cache.dtype).transpose(0, 1),
                                        as_stored(value[start:end], kv_cache.dtype).transpose(0, 1),
                                        scale, sliding_window, softcap, sinks)
                output[start:end] = attended.transpose(0, 1)
            else:
                output[start:end] = _attend_one_gathered(query[start:end], kv_cache, metadata,
                                                         i, scale, sliding_window, softcap,
                                                         sinks)
        return output.view(qkv.shape[0], -1)

    @staticmethod
    def _decode(query, kv_cache, metadata, rows, scale, output, sliding_window, softcap,
                sinks=None):
        """All one-token queries at once as two batched matmuls. Query heads are grouped under
        their KV head ([B, KVH, G, D] x [B, KVH, D, L]) so K/V are never repeated for GQA;
        softmax runs in float32. (CPU SDPA took ~4 ms per layer here: its flash kernel is slow
        for one query row with a mask.)"""
        block_size = metadata.block_size
        seq_lens = [metadata.seq_lens_host[i] for i in rows]
        rows_t = torch.tensor(rows, device=query.device)
        if sliding_window > 0:
            tables, first_keys = _window_blocks(metadata, rows, rows_t, sliding_window)
        else:
            max_blocks = (max(seq_lens) + block_size - 1) // block_size
            tables, first_keys = metadata.block_tables[rows_t, :max_blocks].long(), None
        num_kv_heads, row = kv_cache.shape[3], kv_cache.shape[4]
        head_dim = query.shape[-1]
        batch = len(rows)
        token_index = metadata.query_start_loc[rows_t].long()
        queries = query[token_index].view(batch, num_kv_heads, -1, head_dim)
        flat_tables = tables.flatten()
        # index_select over whole blocks is ~1.7x faster than advanced indexing here
        keys = kv_as(kv_cache[0].index_select(0, flat_tables).view(batch, -1, num_kv_heads, row),
                     query.dtype)
        scores = torch.matmul(queries, keys.transpose(1, 2).transpose(-1, -2)).float() * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        lengths = metadata.seq_lens[rows_t].unsqueeze(1)
        positions = torch.arange(scores.shape[-1], device=query.device).unsqueeze(0)
        if first_keys is not None:  # the gathered keys start at each row's first window block
            positions = positions + first_keys
            valid = (positions < lengths) & (positions >= lengths - sliding_window)
        else:
            valid = positions < lengths
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        if sinks is not None:  # one more column per head that weighs no value
            sink_column = sinks.float().view(1, num_kv_heads, -1, 1).expand(batch, -1, -1, 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        probs = probs.to(query.dtype)
        values = kv_as(kv_cache[1].index_select(0, flat_tables).view(
            batch, -1, num_kv_heads, row), query.dtype).transpose(1, 2)  # [B, KVH, L, D]
        output[token_index] = torch.matmul(probs, values).reshape(batch, -1, head_dim)


def _window_blocks(metadata, rows, rows_t, sliding_window):
    """Block ids [B, M] from each decode row's first block inside its window (those before may
    be stale), and the position of each row's first gathered key [B, 1]. A row with fewer
    blocks repeats its last one: every gathered block is the row's own, so masked keys hold
    real values (a zero probability times a stale NaN would still be NaN)."""
    block_size = metadata.block_size
    first_blocks, last_blocks = [], []
    for i in rows:
        seq_len = metadata.seq_lens_host[i]
        first_blocks.append(first_visible_key(seq_len - 1, sliding_window) // block_size)
        last_blocks.append((seq_len - 1) // block_size)
    width = max(last - first for first, last in zip(first_blocks, last_blocks)) + 1
    first_t = torch.tensor(first_blocks, device=rows_t.device).unsqueeze(1)
    last_t = torch.tensor(last_blocks, device=rows_t.device).unsqueeze(1)
    columns = torch.minimum(first_t + torch.arange(width, device=rows_t.device), last_t)
    tables = metadata.block_tables[rows_t.unsqueeze(1), columns].long()
    return tables, first_t * block_size


def _attend_one_gathered(query, kv_cache, metadata, i, scale, sliding_window, softcap=0.0,
                         sinks=None):
    return attend_gathered(query, kv_cache, metadata.block_tables[i], metadata.seq_lens_host[i],
                           scale, sliding_window, softcap, sinks)


def _paged_backend(use_cpu_kernels: bool):
    from kvserve.attention.paged import PagedBackend
    from kvserve.kernels import get_ops

    return PagedBackend(get_ops(use_cpu_kernels))


_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "paged": _paged_backend,
    TorchReferenceBackend.name: lambda use_cpu_kernels: TorchReferenceBackend(),
    BatchedSDPABackend.name: lambda use_cpu_kernels: BatchedSDPABackend(),
}


def register_backend(name: str, factory: Callable[..., AttentionBackend]) -> None:
    """factory(use_cpu_kernels: bool) -> backend."""
    _BACKENDS[name] = factory


def get_attention_backend(name: str, use_cpu_kernels: bool = True) -> AttentionBackend:
    """`paged` runs the model's fused layer path with the compiled CPU kernels (or, with
    use_cpu_kernels=False or KVSERVE_KERNELS=reference, their torch versions; kernels that do not
    build are a KernelBuildError); the others are eager paths."""
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}")
    return _BACKENDS[name](use_cpu_kernels)


def available_backends() -> list[str]:
    return list(_BACKENDS)
