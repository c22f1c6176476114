"""Phi-3 / Phi-4-mini: Llama's block, with the checkpoint's projections stored fused (qkv_proj,
gate_up_proj, in our parameters' order) and partial rotary (Phi-4-mini's 0.75): RoPE rotates the
first rotary_dim dims of each head, which the fused kernels do as a full-width rotation of heads
whose Q/K rows were reordered at load (`rotary_head_order`)."""

from __future__ import annotations

from kvserve.models.families.llama import LlamaForCausalLM
from kvserve.models.layers.mlp import GatedMLP
from kvserve.models.layers.rotary import rotary_head_order


class Phi3ForCausalLM(LlamaForCausalLM):
    def attention_options(self, config):
        return {"head_order": rotary_head_order(config), "fused_checkpoint": True}

    def feed_forward(self, config, prefix):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        self.quant, f"{prefix}.mlp", self.parallel, fused_checkpoint=True)
