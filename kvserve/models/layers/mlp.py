"""The gated MLP: down(act(gate(x)) * up(x)) with gate and up as one projection (two parts),
SiLU (SwiGLU), tanh GELU (GeGLU) or gpt-oss's clamped SwiGLU ("swigluoai": its gate clamped
above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)), with biases where the
family has them."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext
from kvserve.models.layers.linear import column_parallel, row_parallel
from kvserve.quant import QuantPolicy

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swigluoai")


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str,
                 quant: QuantPolicy, prefix: str, parallel: ParallelContext | None = None,
                 fused_checkpoint: bool = False,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 bias: bool = False, swiglu: tuple[float, float] = (1.702, 7.0)):
        """`intermediate_size`: the whole model's; `prefix`: the module's checkpoint name;
        `fused_checkpoint`: the checkpoint holds gate_up_proj (Phi-3), not gate/up; `names`:
        the gate, up and down projections' checkpoint names (Mixtral's experts: w1, w3, w2);
        `bias`: every projection has one; `swiglu`: swigluoai's (alpha, limit)."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: one of {', '.join(ACTIVATIONS)}")
        self.hidden_act = activation
        self.swiglu_alpha, self.swiglu_limit = swiglu
        gate, up, down = names
        self.gate_up_proj = column_parallel(
            hidden_size, [(gate, intermediate_size), (up, intermediate_size)],
            bias, quant, prefix, parallel, fused_name="gate_up_proj",
            export_fused=fused_checkpoint)
        self.down_proj = row_parallel(intermediate_size, hidden_size, down, bias, quant,
                                      prefix, parallel)

    def forward(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = ops.linear(self.gate_up_proj, hidden)
        return ops.linear(self.down_proj, ops.act_and_mul(gate_up, self.hidden_act, self))
