"""DeepSeek-V3 / R1 and V2 / V2-Lite: Llama's pre-norm block with multi-head latent attention
(models/layers/latent_attention.py) and, past the first `first_k_dense_replace` dense layers,
DeepSeek's mixture: sigmoid router scores, the top k chosen with a per-expert correction bias
among the experts of the best `topk_group` of `n_group` groups (a group scored by its two best
experts), the chosen experts weighted by their uncorrected scores, renormalised and scaled by
`routed_scaling_factor`, plus ungated shared experts (HF's DeepseekV3TopkRouter, op for op).

The router and its choice run in float32 as HF's do, in Python (`route`, the reference) and in
the fused C++ layer (`set_group_limited_routing`, kernels/csrc/moe.cpp), which the engine runs
where it can, as for every mixture."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.families.moe import MoEForCausalLM
from kvserve.models.layers.latent_attention import LatentAttention
from kvserve.models.layers.moe import SparseMoE

_SHARED = re.compile(r"^(model\.layers\.\d+\.mlp)\.shared_experts\.(.+)$")
_HALVES = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([kv])_b_proj\.weight$")


class GroupLimitedMoE(SparseMoE):
    """SparseMoE with DeepSeek's routing: V3's (the module docstring) where the config scores
    by sigmoid; V2's where it scores by softmax (HF's DeepseekV2TopkRouter): a group scored by
    its best expert, the other groups' scores zeroed, the top k's scores as they are (never
    renormalised) times routed_scaling_factor; one group is V2's plain "greedy"."""

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(*args, shared_gated=False, **kwargs)
        self.sigmoid = config.moe_scoring == "sigmoid"
        self.groups, self.topk_groups = config.moe_groups, config.moe_topk_groups
        self.routed_scaling_factor = config.routed_scaling_factor
        if config.moe_correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts),
                                                             requires_grad=False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.gate.weight.float())
        if not self.sigmoid:  # V2
            scores = logits.softmax(dim=-1)
            scores = scores.masked_fill(~self._kept_experts(scores, lambda g: g.amax(-1)), 0.0)
            weights, experts = scores.sort(dim=-1, descending=True, stable=True)
            return (weights[:, :self.top_k] * self.routed_scaling_factor,
                    experts[:, :self.top_k])
        scores = logits.sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        kept = self._kept_experts(
            choice, lambda g: g.topk(min(2, g.shape[-1]), dim=-1)[0].sum(dim=-1))
        choice = choice.masked_fill(~kept, float("-inf"))
        experts = choice.sort(dim=-1, descending=True, stable=True)[1][:, :self.top_k]
        weights = scores.gather(1, experts)
        if self.normalize_top_k:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

    def _kept_experts(self, scores: torch.Tensor, group_score) -> torch.Tensor:
        """[T, experts] True for the experts of each token's `topk_groups` best groups, as
        `group_score` rates a group's [T, groups, per group] scores."""
        per_group = scores.view(-1, self.groups, self.num_experts // self.groups)
        group_scores = group_score(per_group)
        best = group_scores.topk(self.topk_groups, dim=-1)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return kept.repeat_interleave(per_group.shape[-1], dim=1)

    def _build_fused(self, kernels):
        """The C++ layer with this routing (kernels/csrc/moe.h: group_limited)."""
        fused = super()._build_fused(kernels)
        if fused is not None:
            bias = getattr(self.gate, "e_score_correction_bias", None)
            fused.set_group_limited_routing(
                "sigmoid" if self.sigmoid else "softmax", self.groups, self.topk_groups,
                None if bias is None else bias.float().contiguous(),
                self.routed_scaling_factor)
        return fused


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """DeepSeek-V3 / R1, and V2 / V2-Lite, whose differences are their configs' (softmax
    routing, no correction bias)."""

    def attention(self, config: ModelConfig, index: int, prefix: str, rotary) -> LatentAttention:
        return LatentAttention(config, rotary, self.quant, f"{prefix}.self_attn", self.parallel)

    def mixture(self, config: ModelConfig, prefix: str) -> nn.Module:
        return GroupLimitedMoE(config, config.hidden_size, config.num_experts,
                               config.num_experts_per_tok, config.moe_intermediate_size,
                               config.hidden_act, self.quant, prefix, self.parallel,
                               normalize_top_k=config.norm_topk_prob,
                               shared_intermediate_size=config.shared_expert_intermediate_size)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterator:
        """HF's `mlp.shared_experts` is the MoE layer's `shared_expert`; a GGUF's per-head
        halves of kv_b_proj (llama.cpp's attn_k_b, W_UK transposed, and attn_v_b) become
        kv_b_proj again once both have passed."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            match = _SHARED.match(name)
            if match:
                yield f"{match[1]}.shared_expert.{match[2]}", tensor
                continue
            match = _HALVES.match(name)
            if match is None:
                yield name, tensor
                continue
            layer = halves.setdefault(match[1], {})
            layer[match[2]] = _dense(tensor)
            if len(layer) == 2:
                yield f"{match[1]}.kv_b_proj.weight", _joined(self.full_config, layer.pop("k"),
                                                              layer.pop("v"))


def _dense(tensor) -> torch.Tensor:
    """A float tensor as it is, a GGUF's block-quantized one dequantized (kv_b_proj is kept
    in float: models/layers/latent_attention.py)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


def _joined(config: ModelConfig, key_half: torch.Tensor,
            value_half: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads x (qk_nope + v), kv_lora_rank] from W_UK transposed [heads,
    kv_lora_rank, qk_nope] and W_UV [heads, v, kv_lora_rank] (or either flattened to rows, as
    block-quantized rows dequantize)."""
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    key_half = key_half.reshape(heads, rank, config.qk_nope_head_dim)
    value_half = value_half.reshape(heads, config.v_head_dim, rank)
    return torch.cat([key_half.transpose(1, 2), value_half], dim=1).reshape(-1, rank)
