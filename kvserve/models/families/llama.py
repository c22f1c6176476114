"""Llama (2, 3.x), and the families that are Llama's computation under other configs: Mistral
(a window on every layer), SmolLM 2/3 (SmolLM3: no RoPE on every fourth layer, which the
config's `layer_rope` gives the layer as an identity table).

A pre-norm block: attention then a SwiGLU MLP, each after an RMSNorm whose residual add is
fused into it.
"""

from __future__ import annotations

from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.layers.attention import SelfAttention
from kvserve.models.layers.causal_lm import CausalLM
from kvserve.models.layers.mlp import GatedMLP
from kvserve.models.layers.norm import RMSNorm


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)): Llama's block (and Qwen's, Phi-3's)."""

    def __init__(self, config: ModelConfig, self_attn: SelfAttention, mlp: nn.Module,
                 mlp_name: str = "mlp"):
        """`mlp`: a GatedMLP or a SparseMoE, held under `mlp_name` (its checkpoint name:
        Mixtral's block_sparse_moe)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

    def forward(self, ops, positions, hidden, residual, metadata):
        if residual is None:  # the first layer: the residual stream is the embedding
            residual, hidden = hidden, ops.rms_norm(hidden, self.input_layernorm)
        else:
            ops.add_rms_norm_(hidden, residual, self.input_layernorm)
        hidden = self.self_attn(ops, positions, hidden, metadata)
        ops.add_rms_norm_(hidden, residual, self.post_attention_layernorm)
        return self._modules[self.mlp_name](ops, hidden), residual


class LlamaForCausalLM(CausalLM):
    def decoder_layer(self, config, index, prefix, rotary):
        return PreNormDecoderLayer(config, self.attention(config, index, prefix, rotary),
                                   self.feed_forward(config, prefix))

    def attention(self, config: ModelConfig, index: int, prefix: str, rotary) -> SelfAttention:
        return SelfAttention(config.hidden_size, config.num_attention_heads,
                             config.num_key_value_heads, config.head_dim, rotary, self.quant,
                             f"{prefix}.self_attn", bias=config.attention_bias,
                             sliding_window=config.sliding_window(index) or 0,
                             parallel=self.parallel, **self.attention_options(config))

    def attention_options(self, config: ModelConfig) -> dict:
        """What a family adds to Llama's attention (QK-norm, partial rotary, fused names)."""
        return {}

    def feed_forward(self, config: ModelConfig, prefix: str) -> GatedMLP:
        return GatedMLP(config.hidden_size, config.intermediate_size,
                        config.hidden_act, self.quant, f"{prefix}.mlp", self.parallel)
