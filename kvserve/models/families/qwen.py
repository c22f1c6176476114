"""Qwen2 / Qwen2.5 (biases on Q, K and V; windows on the layers its config names) and Qwen3
(QK-norm instead of biases): Llama's block with those attention options."""

from __future__ import annotations

from kvserve.models.families.llama import LlamaForCausalLM
from kvserve.models.layers.attention import QKNorm


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Q/K/V biases come from the config (`attention_bias`, true for Qwen2 by default)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    def attention_options(self, config):
        return {"qk_norm": QKNorm(config.rms_norm_eps)}
