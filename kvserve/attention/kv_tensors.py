"""Allocation of the paged KV cache tensors (one per layer), the only KV memory kvserve owns."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.kernels.reference import kv_row_width


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_layers: int | None = None) -> int:
    """One pool block's bytes: K and V of block_size tokens in `num_layers` layers (default
    all; the hybrid layout's blocks span one group's layers); int8 rows carry their scales."""
    element = torch.tensor([], dtype=dtype).element_size()
    layers = config.num_hidden_layers if num_layers is None else num_layers
    row = kv_row_width(config.head_dim, dtype)
    return 2 * layers * block_size * config.num_key_value_heads * row * element


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str | torch.device = "cpu",
                       num_layers: int | None = None) -> list[torch.Tensor]:
    """Per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, row], zero-filled; row is
    head_dim, or for int8 head_dim codes and a float32 scale's 4 bytes (reference.kv_row_width).
    `num_layers`: a pipeline stage's own layers (default: all of the model's)."""
    shape = (2, num_blocks, block_size, config.num_key_value_heads,
             kv_row_width(config.head_dim, dtype))
    count = config.num_hidden_layers if num_layers is None else num_layers
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
