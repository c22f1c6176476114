"""Latent attention (MLA) over the paged cache: RoPE on the queries' and the shared key's rotary
parts, each new token's row (latent, RoPE key) written to its slot, then per sequence one of two
forms (models/layers/latent_attention.py says why). Decodes, verifications and short chunks
take the absorbed form: each head's query taken into latent space (q_nope W_UK) for every such
token at once, the op set's `latent_attention_` over the cached rows (the C++ kernel,
kernels/csrc/latent_attention.cpp: a task per sequence and group of heads, every head scoring
each row as it is read; or reference.py's torch, a sequence at a time), and W_UV on the weighted
latents. Prompt chunks of EXPANDED_MIN_TOKENS or more take the expanded form: the context's
latents up-projected to per-head keys and values, then torch's SDPA (fewer multiply-adds from
~170 queries on). Scores and the softmax in float32, as the
standard backends; the cache in the model's dtype, or int8 or fp8 e4m3 (the latent and the
RoPE key each quantized per row with its scale, as kernels/reference.py quantizes K and V
rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.reference import kv_as, kv_row_width, to_cache_rows

# Prompt chunks of at least this many tokens attend in the expanded form. Per query and context
# token the absorbed form costs heads x (2 kv_lora_rank + rope) multiply-adds (1,088 a head for
# DeepSeek's 512 + 64), the expanded one heads x (qk_nope + rope + v) (320), plus expanding each
# context token's key and value once, heads x kv_lora_rank x (qk_nope + v) (131,072 a head):
# the expanded form does less from ~170 queries a chunk, and runs on torch's SDPA kernel.
EXPANDED_MIN_TOKENS = 128


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
                     positions: torch.Tensor, metadata: AttentionMetadata,
                     kernels) -> torch.Tensor:
    """`query` [T, heads x (nope + rope)], `latent` [T, kv_lora_rank] (normalised),
    `key_rope` [T, rope] (not yet rotated) -> the heads' outputs [T, heads x v] in the query's
    dtype. Writes the new tokens' rows into `layer.kv_cache` first; the attention over the
    cached rows is `kernels.latent_attention_` (the C++ kernel, or reference.py's torch)."""
    if layer.kv_cache is None:
        raise RuntimeError("KV cache not bound: call model.bind_kv_cache(...) first")
    metadata = metadata.for_group(layer.kv_group)
    tokens, heads, nope = query.shape[0], layer.num_heads, layer.nope_dim
    cos, sin = layer.rotary.cos_sin[positions].chunk(2, dim=-1)
    query = query.view(tokens, heads, nope + layer.rope_dim)
    query_rope = rotate(query[..., nope:], cos[:, None], sin[:, None], layer.interleaved)
    rows = layer.kv_cache.view(-1, layer.kv_cache.shape[-1])
    rows[metadata.slot_mapping] = torch.cat(
        [to_cache_rows(latent, rows.dtype),
         to_cache_rows(rotate(key_rope, cos, sin, layer.interleaved).to(latent.dtype),
                       rows.dtype)], dim=-1)
    starts, lengths = metadata.query_start_loc_host, metadata.seq_lens_host
    expanded = [index for index in range(len(lengths))
                if starts[index + 1] - starts[index] >= EXPANDED_MIN_TOKENS]
    absorbed = [index for index in range(len(lengths))
                if 0 < starts[index + 1] - starts[index] < EXPANDED_MIN_TOKENS]
    if absorbed:  # every token's row; the expanded sequences' are overwritten below
        out = _absorbed(layer, query[..., :nope], query_rope, rows, metadata, absorbed,
                        kernels, partial=bool(expanded))
    else:
        out = torch.empty(tokens, heads, layer.v_dim, dtype=torch.float32)
    for sequence in expanded:
        start, end = starts[sequence], starts[sequence + 1]
        out[start:end] = _expanded(layer, query[start:end, :, :nope].float(),
                                   query_rope[start:end], rows, metadata, sequence,
                                   lengths[sequence])
    return out.reshape(tokens, heads * layer.v_dim).to(query.dtype)


def _absorbed(layer, query_nope: torch.Tensor, query_rope: torch.Tensor, rows: torch.Tensor,
              metadata: AttentionMetadata, sequences: list[int], kernels,
              partial: bool) -> torch.Tensor:
    """The absorbed form for `sequences` (the op set's kernel over the cached rows), each
    step's W_UK and W_UV as one batched matmul over every token: [T, heads, v] in float32, the
    rows of tokens outside `sequences` zero (`partial`) or unset."""
    w_uk, w_uv = layer.absorbed()
    # each head's query in latent space: q_nope W_UK [T, heads, kv_lora_rank]
    query_latent = torch.einsum("thd,hdr->thr", query_nope.float(), w_uk).contiguous()
    weighted = torch.zeros_like(query_latent) if partial else torch.empty_like(query_latent)
    kernels.latent_attention_(weighted, query_latent, query_rope.contiguous(), rows,
                              torch.tensor(sequences, dtype=torch.int32),
                              metadata.query_start_loc, metadata.seq_lens,
                              metadata.block_tables.contiguous(), metadata.block_size,
                              layer.scale)
    return torch.einsum("thr,hvr->thv", weighted, w_uv)


def _expanded(layer, query_nope: torch.Tensor, query_rope: torch.Tensor, rows: torch.Tensor,
              metadata: AttentionMetadata, sequence: int, length: int) -> torch.Tensor:
    """One sequence's prompt chunk in the expanded form: every cached latent up-projected to
    each head's key and value (W_UK, W_UV), then causal attention over them (torch's SDPA).
    [n, heads, v] in float32."""
    w_uk, w_uv = layer.absorbed()
    size = metadata.block_size
    blocks = metadata.block_tables[sequence, :-(-length // size)].long()
    cached = rows[(blocks[:, None] * size + torch.arange(size)).flatten()[:length]]
    split = kv_row_width(layer.kv_lora_rank, rows.dtype)  # where the RoPE key's part starts
    latents = kv_as(cached[:, :split], torch.float32)
    keys_rope = kv_as(cached[:, split:], torch.float32)
    heads = layer.num_heads
    keys = torch.cat([torch.einsum("lr,hdr->hld", latents, w_uk),
                      keys_rope[None].expand(heads, -1, -1)], dim=-1)
    # values zero-padded to the keys' width: torch's fused CPU kernel wants one head size (2.9x
    # faster than its fallback for a 2,048-token prompt on Zen 5; 1.7x under a mask)
    values = F.pad(torch.einsum("lr,hvr->hlv", latents, w_uv),
                   (0, keys.shape[-1] - layer.v_dim))
    queries = torch.cat([query_nope, query_rope], dim=-1).transpose(0, 1)
    count = queries.shape[1]
    if count == length:  # a whole prompt: the plain causal mask
        attended = F.scaled_dot_product_attention(queries[None], keys[None], values[None],
                                                  is_causal=True, scale=layer.scale)[0]
    else:  # a chunk after cached context: each query sees up to its own position
        positions = torch.arange(length - count, length)
        mask = torch.arange(length)[None, :] <= positions[:, None]
        attended = F.scaled_dot_product_attention(queries[None], keys[None], values[None],
                                                  attn_mask=mask, scale=layer.scale)[0]
    return attended[..., :layer.v_dim].transpose(0, 1)
