"""Multi-head latent attention (MLA, DeepSeek-V2/V3): every head's keys and values come from
one latent vector per token (kv_lora_rank wide) and one RoPE key every head shares, and the
paged cache keeps only those: one row of kv_lora_rank + qk_rope_head_dim per token and layer
(`kv_page_layout`), against 2 x heads x head_dim for standard attention.

Attention runs in the absorbed form (DeepSeek's and vLLM's decode path), for prefill too: the
key up-projection is folded into each head's query (q_nope W_UK: a query in latent space) and
the value up-projection applied after the weighted sum of latents (W_UV), so neither keys nor
values are ever expanded per head; a step reads only the cached latents. It is the expanded
form's arithmetic regrouped (equal within float32 rounding: tests/test_deepseek.py against HF).
The attention over the cached rows is a C++ kernel of its own (kvserve/attention/latent.py,
kernels/csrc/latent_attention.cpp), not yet part of the C++ decode stack, so models with this
layer keep the Python loop over their layers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.attention.kv_tensors import KVPageLayout
from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError
from kvserve.kernels.reference import kv_row_width
from kvserve.models.layers.linear import column_parallel, row_parallel
from kvserve.models.layers.norm import RMSNorm
from kvserve.models.layers.rotary import RotaryEmbedding
from kvserve.quant import QuantPolicy


class UpProjection(nn.Module):
    """kv_b_proj's weight [heads x (qk_nope + v), kv_lora_rank], kept in float: the absorbed
    form splits it per head into W_UK and W_UV (`absorbed`) rather than running it as a
    projection."""

    def __init__(self, rows: int, columns: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns), requires_grad=False)


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, quant: QuantPolicy,
                 prefix: str, parallel: ParallelContext | None = None):
        """`config`: the whole model's. With tensor parallelism a rank takes its share of the
        heads (their query rows, kv_b_proj's rows, o_proj's columns, all-reduced); the
        latent's projection and the cached latents are every rank's, whole."""
        super().__init__()
        tp = active(parallel)
        tp_size, tp_rank = (1, 0) if tp is None else (tp.tp_size, tp.tp_rank)
        hidden, heads = config.hidden_size, config.num_attention_heads
        if heads % tp_size:
            raise UnsupportedArchitectureError(
                f"{heads} latent-attention heads do not split over {tp_size} tensor-parallel "
                "ranks")
        self.num_heads = heads // tp_size
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.interleaved = config.rope_interleave
        self.scale = config.scale
        self.rope_kind = rotary.kind
        self._rotary = (rotary,)  # the model owns the table
        q_width = heads * (self.nope_dim + self.rope_dim)
        bias = config.attention_bias
        if config.q_lora_rank:
            self.q_a_proj = column_parallel(hidden, [("q_a_proj", config.q_lora_rank)], bias,
                                            quant, prefix)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = column_parallel(config.q_lora_rank, [("q_b_proj", q_width)], False,
                                            quant, prefix, tp)
        else:
            self.q_proj = column_parallel(hidden, [("q_proj", q_width)], False, quant, prefix,
                                          tp)
        self.kv_a_proj_with_mqa = column_parallel(
            hidden, [("kv_a_proj_with_mqa", self.kv_lora_rank + self.rope_dim)], bias, quant,
            prefix)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        per_head = self.nope_dim + self.v_dim
        self.kv_b_proj = UpProjection(self.num_heads * per_head, self.kv_lora_rank)
        first = tp_rank * self.num_heads * per_head
        self.kv_b_proj.param_loaders = {"weight": _rows_loader(
            first, first + self.num_heads * per_head, heads * per_head)}
        self.o_proj = row_parallel(heads * self.v_dim, hidden, "o_proj", bias, quant, prefix,
                                   tp)
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0
        self._absorbed: tuple | None = None

    @property
    def rotary(self) -> RotaryEmbedding:
        return self._rotary[0]

    def kv_page_layout(self, dtype: torch.dtype) -> KVPageLayout:
        """One row per token: the latent, then the RoPE key; in an int8 or fp8 cache each of
        the two quantized on its own, codes then its float32 scale (their ranges differ)."""
        return KVPageLayout(1, 1, kv_row_width(self.kv_lora_rank, dtype)
                            + kv_row_width(self.rope_dim, dtype), dtype)

    def shift_cached_keys(self, block_ids: torch.Tensor, rotation) -> None:
        raise UnsupportedArchitectureError(
            "attention sinks' window (--streaming-window) does not move latent attention's "
            "RoPE keys yet")

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope, kv_lora_rank] and W_UV [heads, v, kv_lora_rank] in float32,
        split from kv_b_proj once its weights are loaded."""
        weight = self.kv_b_proj.weight
        if self._absorbed is None or self._absorbed[0] is not weight:
            per_head = weight.float().view(self.num_heads, self.nope_dim + self.v_dim, -1)
            self._absorbed = (weight, per_head[:, :self.nope_dim].contiguous(),
                              per_head[:, self.nope_dim:].contiguous())
        return self._absorbed[1], self._absorbed[2]

    def forward(self, ops, positions: torch.Tensor, hidden: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        if hasattr(self, "q_a_proj"):
            query = ops.linear(self.q_b_proj, ops.rms_norm(ops.linear(self.q_a_proj, hidden),
                                                           self.q_a_layernorm))
        else:
            query = ops.linear(self.q_proj, hidden)
        compressed = ops.linear(self.kv_a_proj_with_mqa, hidden)
        attended = ops.latent_attention(self, query, compressed, positions, metadata)
        return ops.linear(self.o_proj, attended)


def _rows_loader(first: int, end: int, rows: int):
    """Load rows [first, end) of a checkpoint tensor of `rows` rows (this rank's heads)."""
    def load(param: torch.Tensor, tensor) -> None:
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if whole.shape[0] != rows:
            raise CorruptModelFileError(
                f"kv_b_proj has {whole.shape[0]} rows; the config gives {rows}")
        param.data.copy_(whole[first:end])

    return load
