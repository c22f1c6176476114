"""Views of the fused QKV rows by head, shared by the attention backends."""

from __future__ import annotations

import torch


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """[T, (H + 2 KVH) * D] -> query [T, H, D], key and value [T, KVH, D] (views)."""
    tokens = qkv.shape[0]
    query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                                   num_kv_heads * head_dim], dim=-1)
    return (query.view(tokens, num_heads, head_dim), key.view(tokens, num_kv_heads, head_dim),
            value.view(tokens, num_kv_heads, head_dim))
