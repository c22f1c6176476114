"""Gemma 2 and Gemma 3 (text): norms that scale by (1 + weight) in float32 around both the
attention and the MLP (before and after each), a GeGLU MLP, the embedding scaled by
sqrt(hidden), attention scaled by query_pre_attn_scalar; Gemma 2 soft-caps attention scores and
the final logits, Gemma 3 normalises Q and K per head and gives its sliding-window layers their
own RoPE base (the config's `layer_rope`: "local")."""

from __future__ import annotations

from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.layers.attention import QKNorm, SelfAttention
from kvserve.models.layers.causal_lm import CausalLM
from kvserve.models.layers.mlp import GatedMLP
from kvserve.models.layers.norm import RMSNorm

NORM_OFFSET = 1.0


class SandwichDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, config: ModelConfig, self_attn: SelfAttention, mlp: GatedMLP):
        super().__init__()

        def norm():
            return RMSNorm(config.hidden_size, config.rms_norm_eps, NORM_OFFSET)

        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.mlp = mlp

    def forward(self, ops, positions, hidden, residual, metadata):
        if residual is None:
            residual, hidden = hidden, ops.rms_norm(hidden, self.input_layernorm)
        else:
            ops.add_rms_norm_(hidden, residual, self.input_layernorm)
        attended = ops.rms_norm(self.self_attn(ops, positions, hidden, metadata),
                                self.post_attention_layernorm)
        ops.add_rms_norm_(attended, residual, self.pre_feedforward_layernorm)
        hidden = self.mlp(ops, attended)
        return ops.rms_norm(hidden, self.post_feedforward_layernorm), residual


class Gemma2ForCausalLM(CausalLM):
    norm_weight_offset = NORM_OFFSET
    qk_norm = False

    def embedding_multiplier(self, config):
        return config.embedding_multiplier

    def decoder_layer(self, config, index, prefix, rotary):
        attention = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary, self.quant, f"{prefix}.self_attn", scale=config.scale,
            bias=config.attention_bias, sliding_window=config.sliding_window(index) or 0,
            softcap=config.attn_logit_softcapping or 0.0, parallel=self.parallel,
            qk_norm=QKNorm(config.rms_norm_eps, NORM_OFFSET) if self.qk_norm else None)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       self.quant, f"{prefix}.mlp", self.parallel)
        return SandwichDecoderLayer(config, attention, mlp)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
