"""RMSNorm as a parameter holder: its weight, epsilon and Gemma's weight offset. Layers normalise
through the op set (`LayerOps.rms_norm`), so the compiled kernels, their torch versions and the
decode stack all apply the same weights the same way."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.reference import rms_norm


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm, or with `weight_offset` (Gemma: 1) its GemmaRMSNorm, which keeps
    the checkpoint's weight w and scales by (1 + w) in float32 (kernels/reference.py::rms_norm
    defines the arithmetic)."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        # a factory, not ones() - offset: built on meta, arithmetic would pull in torch's meta
        # reference ops and torch._dynamo (seconds at start-up)
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - weight_offset))
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The torch reference's arithmetic (for callers outside a layer's op set)."""
        return rms_norm(hidden, self.weight, self.eps, self.weight_offset)
