"""The operations a layer's forward is written against, once: RMSNorm (with the residual add
fused), projections, an in-place add, gated activations, QK-norm, attention (RoPE, the cache
write, the attention backend) and a mixture of experts. `LayerOps` runs them on an op set (the compiled C++ kernels or their torch
versions, kvserve/kernels) and an attention backend; the decode stack's recorder
(models/decode_stack.py) implements the same methods to capture a layer's op sequence, so the
C++ stack is assembled from the layers' own forwards rather than written a second time.

Each method takes the module that holds the op's weights and settings (a norm, a linear, an
attention layer), so the recorder can read them without the forward passing tensors around.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.attention.latent import latent_attention


class LayerOps:
    def __init__(self, kernels, backend):
        """`kernels`: an op set (kvserve.kernels.get_ops); `backend`: the attention backend,
        which attends over the cache once RoPE and the cache write are done."""
        self.kernels = kernels
        self.backend = backend

    def rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.weight_offset)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> None:
        """residual += x; x = norm(residual), both in place (vLLM's fused_add_rms_norm)."""
        self.kernels.add_rms_norm_(x, residual, norm.weight, norm.eps, norm.weight_offset)

    def add_(self, x: torch.Tensor, other: torch.Tensor) -> None:
        """x += other (a parallel block's two branches)."""
        x.add_(other)

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # .forward, not __call__: the hook checks cost ~1 us, ~120 times a step
        return layer.forward(x)

    def act_and_mul(self, gate_up: torch.Tensor, activation: str,
                    mlp: nn.Module | None = None) -> torch.Tensor:
        """act(gate) * up over [T, 2I] rows: SiLU (SwiGLU), tanh GELU (GeGLU), or gpt-oss's
        clamped SwiGLU with the `mlp`'s constants."""
        if activation == "silu":
            return self.kernels.silu_and_mul(gate_up)
        if activation == "swigluoai":
            return self.kernels.swigluoai_and_mul(gate_up, mlp.swiglu_alpha, mlp.swiglu_limit)
        return self.kernels.gelu_tanh_and_mul(gate_up)

    def norm_heads_(self, qkv: torch.Tensor, attention: nn.Module) -> None:
        """QK-norm: the layer's query and key heads normalised in place (before RoPE)."""
        q_norm, k_norm = attention.q_norm, attention.k_norm
        self.kernels.rms_norm_heads_(qkv, q_norm.weight, k_norm.weight, attention.num_heads,
                                     attention.num_kv_heads, attention.head_dim, q_norm.eps,
                                     q_norm.weight_offset)

    def norm_projections_(self, qkv: torch.Tensor, attention: nn.Module) -> None:
        """RMSNorm over the whole query and key projections (OLMoE; `norm_heads_` normalises
        each head), in place."""
        q_size, kv_size = attention.q_size, attention.kv_size
        for part, norm in ((qkv[:, :q_size], attention.q_norm),
                           (qkv[:, q_size:q_size + kv_size], attention.k_norm)):
            part.copy_(self.kernels.rms_norm(part.contiguous(), norm.weight, norm.eps,
                                             norm.weight_offset))

    def clamp_(self, x: torch.Tensor, limit: float) -> None:
        """x clamped to [-limit, limit] in place (OLMoE's clip_qkv)."""
        x.clamp_(-limit, limit)

    def attention(self, attention: nn.Module, qkv: torch.Tensor, positions: torch.Tensor,
                  metadata: AttentionMetadata) -> torch.Tensor:
        """RoPE on the fused QKV rows' Q and K and their K/V written to the layer's cache (one
        op), then attention over the cache: [T, H * D]."""
        if attention.kv_cache is None:
            raise RuntimeError("KV cache not bound: call model.bind_kv_cache(...) first")
        metadata = metadata.for_group(attention.kv_group)
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, \
            attention.head_dim
        self.kernels.rope_and_cache_(qkv, positions, attention.rotary.cos_sin, attention.kv_cache,
                                     metadata.slot_mapping, heads, kv_heads, head_dim)
        return self.backend.attend(qkv, attention.kv_cache, metadata, heads, kv_heads, head_dim,
                                   attention.scale, attention.sliding_window, attention.softcap,
                                   attention.sink_logits)

    def latent_attention(self, attention: nn.Module, query: torch.Tensor,
                         compressed: torch.Tensor, positions: torch.Tensor,
                         metadata: AttentionMetadata) -> torch.Tensor:
        """Latent attention (MLA, models/layers/latent_attention.py) from the queries and
        kv_a_proj_with_mqa's rows (the latent, then the RoPE key): the latent normalised,
        RoPE, the rows written to the layer's cache, attention in the absorbed form:
        [T, H * v_head_dim]."""
        rank = attention.kv_lora_rank
        latent = self.rms_norm(compressed[:, :rank].contiguous(), attention.kv_a_layernorm)
        return latent_attention(attention, query, latent, compressed[:, rank:], positions,
                                metadata, self.kernels)

    def moe(self, moe: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """A mixture of experts (models/layers/moe.py): routing, each active expert's
        projections over its tokens, the weighted sum."""
        return moe.run(self, hidden)

    def all_reduce_(self, x: torch.Tensor, tp) -> None:
        """Tensor parallelism: partial sums (row-parallel outputs) summed over the ranks."""
        tp.communicator.all_reduce_(x)
