"""Latent attention (MLA) over the paged cache, in torch: RoPE on the queries' and the shared
key's rotary parts, each new token's row (latent, RoPE key) written to its slot, then per
sequence the absorbed form over its cached rows (models/layers/latent_attention.py says why).
Scores and the softmax in float32, as the standard backends; the cache in the model's dtype, or
int8 or fp8 e4m3 (the latent and the RoPE key each quantized per row with its scale, as
kernels/reference.py quantizes K and V rows)."""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.reference import kv_as, kv_row_width, to_cache_rows


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """RoPE over x's last dim (float32 cos and sin of half its width, broadcast): pairs
    (x[i], x[i + d/2]), or with `interleaved` pairs (x[2i], x[2i + 1]) written out as the first
    and second halves (HF's apply_rotary_pos_emb_interleave: queries and keys alike, so their
    dot products are the interleaved rotation's)."""
    x = x.float()
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def latent_attention(layer, query: torch.Tensor, latent: torch.Tensor, key_rope: torch.Tensor,
                     positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """`query` [T, heads x (nope + rope)], `latent` [T, kv_lora_rank] (normalised),
    `key_rope` [T, rope] (not yet rotated) -> the heads' outputs [T, heads x v] in the query's
    dtype. Writes the new tokens' rows into `layer.kv_cache` first."""
    if layer.kv_cache is None:
        raise RuntimeError("KV cache not bound: call model.bind_kv_cache(...) first")
    metadata = metadata.for_group(layer.kv_group)
    tokens, heads, nope = query.shape[0], layer.num_heads, layer.nope_dim
    cos, sin = layer.rotary.cos_sin[positions].chunk(2, dim=-1)
    query = query.view(tokens, heads, nope + layer.rope_dim)
    query_rope = rotate(query[..., nope:], cos[:, None], sin[:, None], layer.interleaved)
    rows = layer.kv_cache.view(-1, layer.kv_cache.shape[-1])
    split = kv_row_width(layer.kv_lora_rank, rows.dtype)  # where the RoPE key's part starts
    rows[metadata.slot_mapping] = torch.cat(
        [to_cache_rows(latent, rows.dtype),
         to_cache_rows(rotate(key_rope, cos, sin, layer.interleaved).to(latent.dtype),
                       rows.dtype)], dim=-1)
    w_uk, w_uv = layer.absorbed()
    # each head's query in latent space: q_nope W_UK [T, heads, kv_lora_rank]
    query_latent = torch.einsum("thd,hdr->thr", query[..., :nope].float(), w_uk)
    out = torch.empty(tokens, heads, layer.v_dim, dtype=torch.float32)
    starts, lengths = metadata.query_start_loc_host, metadata.seq_lens_host
    for index, length in enumerate(lengths):
        start, end = starts[index], starts[index + 1]
        if end == start:
            continue
        cached = rows[_sequence_slots(metadata, index, length)]
        latents = kv_as(cached[:, :split], torch.float32)
        keys_rope = kv_as(cached[:, split:], torch.float32)
        scores = (torch.einsum("thr,lr->htl", query_latent[start:end], latents)
                  + torch.einsum("thp,lp->htl", query_rope[start:end], keys_rope)) * layer.scale
        first_position = length - (end - start)
        query_positions = torch.arange(first_position, length)
        future = torch.arange(length)[None, :] > query_positions[:, None]
        probabilities = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        weighted = torch.einsum("htl,lr->thr", probabilities, latents)
        out[start:end] = torch.einsum("thr,hvr->thv", weighted, w_uv)
    return out.view(tokens, heads * layer.v_dim).to(query.dtype)


def _sequence_slots(metadata: AttentionMetadata, index: int, length: int) -> torch.Tensor:
    """The cache slots of sequence `index`'s first `length` tokens, from its block table."""
    size = metadata.block_size
    blocks = metadata.block_tables[index, :-(-length // size)].long()
    return (blocks[:, None] * size + torch.arange(size)).flatten()[:length]
