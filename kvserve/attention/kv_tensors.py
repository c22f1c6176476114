"""The paged KV cache's memory, the only KV memory kvserve owns: each attention layer declares
its page layout (`KVPageLayout`: what one token of one layer keeps, and in how many bytes), and
the pool's sizing and the workers' allocation read it. Standard attention keeps two planes, K
and V, of `heads` rows each; a latent-attention layer (DeepSeek's MLA) will declare one plane
of one latent row, and nothing that sizes or allocates changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.huge_pages import zeros_on_huge_pages
from kvserve.kernels.reference import kv_row_width


@dataclass(frozen=True)
class KVPageLayout:
    """One layer's KV page: `planes` planes (K and V: 2) of `heads` rows of `row` elements of
    `dtype` per token; a quantized row (int8, or fp8 e4m3 stored as uint8) carries its float32
    scale in its last 4 bytes."""

    planes: int
    heads: int
    row: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.planes * self.heads * self.row * element

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[planes, num_blocks, block_size, heads, row]: a block's slots contiguous per plane,
        as the kernels read them."""
        return (self.planes, num_blocks, block_size, self.heads, self.row)

    def allocate(self, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu") -> torch.Tensor:
        shape = self.shape(num_blocks, block_size)
        if torch.device(device).type == "cpu":
            return zeros_on_huge_pages(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device)


def attention_page_layout(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVPageLayout:
    """Standard (multi-, grouped- or multi-query) attention: K and V rows of head_dim, or for
    int8 and fp8 head_dim codes and a float32 scale's 4 bytes (reference.kv_row_width)."""
    return KVPageLayout(2, num_kv_heads, kv_row_width(head_dim, dtype), dtype)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_layers: int | None = None) -> int:
    """One pool block's bytes over `num_layers` layers (default all) of a standard-attention
    `config` (tools' estimates; the engine sizes its pool from the page its workers' layers
    declare, `WorkerReady.kv_page_bytes`)."""
    layout = attention_page_layout(config.num_key_value_heads, config.head_dim, dtype)
    layers = config.num_hidden_layers if num_layers is None else num_layers
    return layers * layout.bytes_per_block(block_size)


def allocate_kv_caches(layouts: list[KVPageLayout], num_blocks: int, block_size: int,
                       device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One zero-filled tensor per layout (per layer, or per tensor of the hybrid layout)."""
    return [layout.allocate(num_blocks, block_size, device) for layout in layouts]
