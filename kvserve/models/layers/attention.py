"""Multi-head (grouped-query) self-attention over the paged KV cache: the fused QKV projection,
optional QK-norm, RoPE from the model's table for this layer, the attention backend, the output
projection. Everything a family varies (biases, window, soft cap, learned sinks, query scale,
QK-norm, which RoPE table, partial rotary's head order, fused checkpoint names) is a constructor
argument, so a family composes it rather than switching on its own name here.

The layer declares its KV cache: `kv_heads`, `head_dim` and `sliding_window` (models/layers/
kv_spec.py turns them into the cache's page layout and bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.attention.kv_tensors import KVPageLayout, attention_page_layout
from kvserve.attention import AttentionMetadata
from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.distributed.sharding import kv_heads_of_rank
from kvserve.errors import CorruptModelFileError
from kvserve.models.layers.linear import qkv_parallel, row_parallel
from kvserve.models.layers.norm import RMSNorm
from kvserve.models.layers.rotary import RotaryEmbedding, rotate_cached_keys
from kvserve.quant import QuantPolicy


@dataclass(frozen=True)
class QKNorm:
    """RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)."""

    eps: float
    weight_offset: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, quant: QuantPolicy, prefix: str, *,
                 scale: float | None = None, bias: bool = False, sliding_window: int = 0,
                 softcap: float = 0.0, qk_norm: QKNorm | None = None,
                 head_order: torch.Tensor | None = None, fused_checkpoint: bool = False,
                 output_bias: bool = False, sinks: bool = False,
                 parallel: ParallelContext | None = None):
        """`num_heads`, `num_kv_heads`: the whole model's (a tensor-parallel rank holds its
        share); `prefix`: the module's checkpoint name ("model.layers.3.self_attn");
        `rotary`: the model's RoPE table this layer uses (shared, not owned); `head_order`:
        partial rotary's reordering of each Q/K head (rotary.rotary_head_order);
        `output_bias`: o_proj has a bias (gpt-oss); `sinks`: each query head has a learned sink
        logit (checkpoint `<prefix>.sinks`), one more softmax term that weighs no value."""
        super().__init__()
        tp = active(parallel)
        tp_size, tp_rank = (1, 0) if tp is None else (tp.tp_size, tp.tp_rank)
        self.num_heads = num_heads // tp_size
        first, end = kv_heads_of_rank(num_kv_heads, tp_size, tp_rank)
        self.num_kv_heads = end - first
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window  # 0: full attention
        self.softcap = softcap  # Gemma 2's score capping; 0: none
        self.rope_kind = rotary.kind
        self._rotary = (rotary,)  # a tuple: the model owns the table, not this layer
        self.qkv_proj = qkv_parallel(hidden_size, head_dim, num_heads, num_kv_heads, bias, quant,
                                     prefix, tp, head_order=head_order,
                                     export_fused=fused_checkpoint)
        self.o_proj = row_parallel(num_heads * head_dim, hidden_size, "o_proj", output_bias,
                                   quant, prefix, tp)
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            first = tp_rank * self.num_heads
            self.param_loaders = {"sinks": _head_range_loader(first, first + self.num_heads,
                                                                num_heads)}
        if qk_norm is None:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = RMSNorm(head_dim, qk_norm.eps, qk_norm.weight_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm.eps, qk_norm.weight_offset)
            if head_order is not None:  # the norms' weights follow the heads' new order
                for norm in (self.q_norm, self.k_norm):
                    norm.param_loaders = {"weight": _reordered_loader(head_order)}
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0  # its KV cache group (the hybrid layout): whose block tables it reads

    @property
    def rotary(self) -> RotaryEmbedding:
        return self._rotary[0]

    @property
    def sink_logits(self) -> torch.Tensor | None:
        """The sinks in float32, as the kernels take them (None: no sinks)."""
        return None if self.sinks is None else self.sinks.float()

    def kv_page_layout(self, dtype: torch.dtype) -> KVPageLayout:
        """What one token of this layer keeps in the paged cache (this rank's KV heads)."""
        return attention_page_layout(self.num_kv_heads, self.head_dim, dtype)

    def shift_cached_keys(self, block_ids: torch.Tensor,
                          rotation: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rotate the keys this layer cached in `block_ids` by `rotation` (attention sinks'
        window moving back, worker/streaming.py): its page's first plane holds the keys. A
        layer with another page layout rotates whatever of its page carries RoPE."""
        keys = self.kv_cache[0]
        keys[block_ids] = rotate_cached_keys(keys[block_ids], rotation)

    def forward(self, ops, positions: torch.Tensor, hidden: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = ops.linear(self.qkv_proj, hidden)
        if self.q_norm is not None:
            ops.norm_heads_(qkv, self)
        attended = ops.attention(self, qkv, positions, metadata)
        return ops.linear(self.o_proj, attended)


def _head_range_loader(first: int, end: int, heads: int):
    """Load a per-head tensor of `heads` entries, this rank's [first, end)."""
    def load(param: torch.Tensor, tensor) -> None:
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if tuple(whole.shape) != (heads,):
            raise CorruptModelFileError(f"a per-head tensor of shape {list(whole.shape)}; the "
                                        f"config gives {heads} heads")
        param.data.copy_(whole[first:end])

    return load


def _reordered_loader(order: torch.Tensor):
    def load(param: torch.Tensor, tensor: torch.Tensor) -> None:
        param.data.copy_(tensor[order])

    load.export_order = torch.argsort(order)
    return load
