"""Mixtures of experts on the pre-norm block: Mixtral (Mistral's layers, every MLP a mixture of
8 experts, top 2 renormalised; checkpoints name it block_sparse_moe and its experts' projections
w1, w3, w2), Qwen2-MoE (Qwen2's attention with Q/K/V biases, a shared expert with a sigmoid gate
beside 60 routed ones), Qwen3-MoE (Qwen3's QK-norm) and OLMoE (QK-norm over whole
projections, an optional clamp of Q, K and V). The Qwen mixtures may leave layers
dense (`ModelConfig.moe_layers`: decoder_sparse_step, mlp_only_layers). Each loads from an HF
directory or a GGUF (config/builtin_families.py names llama.cpp's tensors)."""

from __future__ import annotations

from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import active
from kvserve.errors import UnsupportedArchitectureError
from kvserve.models.families.llama import LlamaForCausalLM, PreNormDecoderLayer
from kvserve.models.layers.attention import QKNorm, SelfAttention
from kvserve.models.layers.moe import SparseMoE
from kvserve.models.layers.norm import RMSNorm


class MoEForCausalLM(LlamaForCausalLM):
    """Llama's block whose MLP is a SparseMoE on the config's MoE layers."""

    mlp_name = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def decoder_layer(self, config, index, prefix, rotary):
        attention = self.attention(config, index, prefix, rotary)
        if not config.is_moe_layer(index):
            return PreNormDecoderLayer(config, attention, self.feed_forward(config, prefix))
        return PreNormDecoderLayer(config, attention,
                                   self.mixture(config, f"{prefix}.{self.mlp_name}"),
                                   self.mlp_name)

    def mixture(self, config: ModelConfig, prefix: str) -> nn.Module:
        return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, config.hidden_act, self.quant, prefix,
                         self.parallel, normalize_top_k=config.norm_topk_prob,
                         shared_intermediate_size=config.shared_expert_intermediate_size,
                         expert_names=self.expert_names, router_bias=config.moe_router_bias,
                         expert_bias=config.moe_expert_bias,
                         swiglu=(config.swiglu_alpha, config.swiglu_limit))


class MixtralForCausalLM(MoEForCausalLM):
    mlp_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Q/K/V biases come from the config (`qkv_bias`, true by default)."""


class Qwen3MoeForCausalLM(MoEForCausalLM):
    def attention_options(self, config):
        return {"qk_norm": QKNorm(config.rms_norm_eps)}


class ProjectionNormAttention(SelfAttention):
    """OLMoE's attention: RMSNorm over the whole query and key projections before RoPE (its
    weights of hidden and KV width), then Q, K and V clamped where the config says."""

    def __init__(self, *args, clip_qkv: float | None = None, eps: float = 1e-5, **kwargs):
        super().__init__(*args, **kwargs)
        if active(kwargs.get("parallel")) is not None:
            raise UnsupportedArchitectureError(
                "OLMoE's QK-norm spans every head, so its attention cannot be split over "
                "tensor-parallel ranks yet")
        self.q_norm = RMSNorm(self.q_size, eps)
        self.k_norm = RMSNorm(self.kv_size, eps)
        self.clip_qkv = clip_qkv

    def forward(self, ops, positions, hidden, metadata):
        qkv = ops.linear(self.qkv_proj, hidden)
        ops.norm_projections_(qkv, self)
        if self.clip_qkv is not None:
            ops.clamp_(qkv, self.clip_qkv)
        attended = ops.attention(self, qkv, positions, metadata)
        return ops.linear(self.o_proj, attended)


class OlmoeForCausalLM(MoEForCausalLM):
    def attention(self, config: ModelConfig, index: int, prefix: str, rotary) -> SelfAttention:
        return ProjectionNormAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary, self.quant, f"{prefix}.self_attn",
            bias=config.attention_bias, parallel=self.parallel, clip_qkv=config.clip_qkv,
            eps=config.rms_norm_eps)
