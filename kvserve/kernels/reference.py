"""The torch-op versions of the fused CPU kernels: same signatures, same maths, written as plain
eager PyTorch. They are the fallback when the C++ build is unavailable and the reference the
kernels are tested against (tests/test_kernels.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_cache_(qkv, positions, cos_sin, kv_cache, slot_mapping, num_heads: int,
                    num_kv_heads: int, head_dim: int) -> None:
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos, sin = cos_sin[positions].to(qkv.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1)
    heads = qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim)
    first, second = heads.chunk(2, dim=-1)
    heads.copy_(heads * cos + torch.cat([-second, first], dim=-1) * sin)
    key = qkv[:, q_size: q_size + kv_size].reshape(-1, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size:].reshape(-1, num_kv_heads, head_dim)
    write_kv(key, value, kv_cache, slot_mapping)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter K/V [T, KVH, D] into their cache slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def attend_gathered(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's new queries [n, H, D] (the last n of its seq_len tokens) against all its
    cached K/V, gathered from its blocks; causal. The reference algorithm -> [n, H, D]."""
    query_len, block_size = query.shape[0], kv_cache.shape[2]
    blocks = block_table[: (seq_len + block_size - 1) // block_size].long()
    keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
    mask = torch.arange(seq_len, device=query.device)[None, :] <= query_positions[:, None]
    attended = F.scaled_dot_product_attention(  # 4-D inputs: 3-D ones take a slow CPU path
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)[0]
    return attended.transpose(0, 1)


def paged_attention_(qkv, kv_cache, out, seq_ids, query_start_loc, seq_lens, block_tables,
                     num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
    for seq in seq_ids.tolist():
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        query = qkv[start:end, : num_heads * head_dim].reshape(end - start, num_heads, head_dim)
        attended = attend_gathered(query, kv_cache, block_tables[seq], int(seq_lens[seq]), scale)
        out[start:end] = attended.reshape(end - start, -1)


# The flash kernel computes the same attention as the paged one (tiled, bf16 dot products).
flash_attention_ = paged_attention_


def flash_attention_supported(head_dim: int) -> bool:
    """The torch ops have no separate tiled kernel; the attention backend routes to it only when
    the compiled one is loaded."""
    return False


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = x.float()
    scale = values.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (values / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int32(acc, token_scale, weight_scale, bias, dtype) -> torch.Tensor:
    out = acc.float() * token_scale[:, None] * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
