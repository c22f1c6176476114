"""Building blocks shared by decoder models: RMSNorm and rotary position embeddings.

Numerics follow HF transformers (norms in float32, RoPE tables in float32 cast to the activation
dtype) so float32 runs match the reference to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.config import ModelConfig


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm, or with `weight_offset` (Gemma: 1) its GemmaRMSNorm, which keeps
    the checkpoint's weight w and scales by (1 + w) in float32."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) - weight_offset)
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden = hidden.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        if self.weight_offset:
            return (hidden * (self.weight_offset + self.weight.float())).to(input_dtype)
        return self.weight * hidden.to(input_dtype)


def rope_inverse_frequencies(config: ModelConfig, kind: str = "global") -> torch.Tensor:
    """Per-pair rotation frequencies of one of the config's RoPE tables (`layer_rope`):
    "global" with Llama 3 / linear scaling applied, "local" (Gemma 3's sliding layers) at
    local_rope_theta unscaled, "none" all zero (cos 1, sin 0: the identity rotation)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "none":
        return torch.zeros(dim // 2)
    if kind == "local":
        return 1.0 / (config.local_rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if kind is not None:
        raise NotImplementedError(f"RoPE scaling {kind!r} is not implemented")
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_factor = float(scaling["low_freq_factor"])
    high_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_context / low_factor
    high_wavelen = old_context / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half ("neox") RoPE from a precomputed float32 cos/sin table indexed by position.

    `freq_factors` (persistent, all ones unless a GGUF ships `rope_freqs`) divides the base
    frequencies, as llama.cpp does for Llama 3 long-context scaling.
    """

    def __init__(self, config: ModelConfig, kind: str = "global"):
        super().__init__()
        self.config = config
        self.kind = kind  # which of the config's tables (rope_inverse_frequencies)
        self.max_positions = config.max_position_embeddings
        if kind == "global":  # a GGUF's rope_freqs scale the (Llama 3) global table only
            self.register_buffer("freq_factors", torch.ones(config.head_dim // 2))
        else:
            self.freq_factors = None
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the cos/sin table from the config and freq_factors, in float32, on
        freq_factors' device (the global table), else `device` (else the default)."""
        factors = self.freq_factors
        if factors is not None:
            device = factors.device
        inv_freq = rope_inverse_frequencies(self.config, self.kind).to(device)
        if factors is not None:
            inv_freq = inv_freq / factors.float()
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [T, 1, D] for these positions, once per step (shared by all layers)."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(query: torch.Tensor, key: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
    """query [T, H, D], key [T, KVH, D] -> rotated (same shapes and dtype)."""
    cos, sin = rotary
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
