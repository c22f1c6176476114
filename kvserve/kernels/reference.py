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
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention_(qkv, kv_cache, out, seq_ids, query_start_loc, seq_lens, block_tables,
                     num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
    block_size = kv_cache.shape[2]
    for seq in seq_ids.tolist():
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        seq_len, query_len = int(seq_lens[seq]), end - start
        blocks = block_tables[seq, : (seq_len + block_size - 1) // block_size].long()
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
        query = qkv[start:end, : num_heads * head_dim].reshape(query_len, num_heads, head_dim)
        query_positions = torch.arange(seq_len - query_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= query_positions[:, None]
        attended = F.scaled_dot_product_attention(  # 4-D: torch's fast CPU kernel
            query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True)[0]
        out[start:end] = attended.transpose(0, 1).reshape(query_len, -1)


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
