"""Rotary position embeddings: the tables of every RoPE scaling HF transformers computes
(linear, Llama 3, YaRN, LongRoPE), partial rotary as a reordering of heads, and rotations of keys
already in the cache (attention sinks).

Numerics follow HF transformers (tables in float32, cast to the activation dtype), so float32
runs match the reference to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kernels.reference import kv_as, to_cache_rows


def rope_inverse_frequencies(config: ModelConfig, kind: str = "global") -> torch.Tensor:
    """Per-pair rotation frequencies (rotary_dim / 2 of them) of one of the config's RoPE tables
    (`layer_rope`): "global" with its scaling applied (linear, Llama 3, YaRN, LongRoPE), "local"
    (Gemma 3's sliding layers) at local_rope_theta unscaled, "none" all zero (cos 1, sin 0: the
    identity rotation). Each as HF transformers 5 computes it, op for op, in float32."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "none":
        return torch.zeros(dim // 2)
    if kind == "local":
        return 1.0 / (config.local_rope_theta**exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "yarn":
        return _yarn_inverse_frequencies(config, scaling, exponents)
    if kind == "longrope":
        factors = scaling["long_factor" if longrope_uses_long_factors(config) else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if kind is not None:
        raise NotImplementedError(f"RoPE scaling {kind!r} is not implemented")
    return inv_freq


def rope_attention_scaling(config: ModelConfig, kind: str = "global") -> float:
    """What YaRN and LongRoPE multiply cos and sin by (HF's `attention_scaling`, vLLM's
    mscale): so both queries and keys, and the scores by its square. 1 for other tables."""
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type")
    if kind != "global" or rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _context_factor(config, scaling)
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        original = scaling["original_max_position_embeddings"]
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def longrope_uses_long_factors(config: ModelConfig) -> bool:
    """LongRoPE's factor set, chosen once per model: the long factors when the engine may serve
    sequences longer than the pretraining context, else the short ones (vLLM's and llama.cpp's
    rule). HF instead picks per forward call by the sequence's length and recomputes the cache
    when a sequence crosses over; one table keeps cached keys (and prefix hits) valid, and equals
    HF's for every sequence on the same side of original_max_position_embeddings as the
    engine's max_model_len."""
    serving = config.max_model_len or config.max_position_embeddings
    return serving > config.rope_scaling["original_max_position_embeddings"]


def _context_factor(config: ModelConfig, scaling: dict) -> float:
    """The scaling's `factor`, else (Phi-3, DeepSeek) context over pretraining context."""
    factor = scaling.get("factor")
    if factor is None:
        return config.max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inverse_frequencies(config: ModelConfig, scaling: dict,
                              exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) frequencies for long wavelengths, the original
    ones for short, a linear ramp between the dims that turn beta_fast and beta_slow times over
    the pretraining context (HF's _compute_yarn_parameters, `truncate` included)."""
    dim, base = config.rotary_dim, config.rope_theta
    factor = _context_factor(config, scaling)
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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


def rotary_head_order(config: ModelConfig) -> torch.Tensor | None:
    """Partial RoPE as full-width rotate-half: where each dim of our query/key heads comes from
    in HF's head layout, or None when RoPE rotates whole heads.

    Rotate-half over head_dim D pairs dim i with i + D/2; partial RoPE over the first R dims
    pairs j with j + R/2. No cos/sin table can turn one into the other (the output at j needs
    input j + R/2, which a full-width rotation never reads there), so the Q and K projection
    rows are permuted once, at load: HF's pair (j, j + R/2) lands on (j, j + D/2) and the D - R
    pass-through dims on the remaining pairs, whose table entries are cos 1, sin 0. Each
    rotated value is then computed by the same float ops as HF's (x * 1 + y * 0 is x, exactly),
    and a score q.k sums the same products in another order: attention is unchanged, to
    rounding of that sum. V, the KV cache's values and the output are untouched; the cache's
    keys hold our order (only this model reads them)."""
    dim, rotary = config.head_dim, config.rotary_dim
    if rotary == dim:
        return None
    half, rotary_half = dim // 2, rotary // 2
    passed = list(range(rotary, dim))
    first = list(range(rotary_half)) + passed[: half - rotary_half]
    second = list(range(rotary_half, rotary)) + passed[half - rotary_half:]
    return torch.tensor(first + second, device="cpu")  # real values, even under a meta build


class RotaryEmbedding(nn.Module):
    """Rotate-half ("neox") RoPE from a precomputed float32 cos/sin table indexed by position:
    [positions, head_dim], cos then sin, each of head_dim / 2 pairs. With partial rotary the
    pairs beyond rotary_dim / 2 are the identity (`rotary_head_order`).

    `freq_factors` (persistent, all ones unless a GGUF ships `rope_freqs`) divides the base
    frequencies, as llama.cpp does for Llama 3 long-context scaling.
    """

    def __init__(self, config: ModelConfig, kind: str = "global"):
        super().__init__()
        self.config = config
        self.kind = kind  # which of the config's tables (rope_inverse_frequencies)
        self.max_positions = config.max_position_embeddings
        if kind == "global":  # a GGUF's rope_freqs scale the (Llama 3) global table only
            self.register_buffer("freq_factors", torch.ones(config.rotary_dim // 2))
        else:
            self.freq_factors = None
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the cos/sin table from the config and freq_factors, in float32, on
        freq_factors' device (the global table), else `device` (else the default). cos and sin
        are multiplied by the attention scaling as HF does (after cos/sin, in float32)."""
        factors = self.freq_factors
        if factors is not None:
            device = factors.device
        if (device or torch.empty(0).device).type == "meta":  # a model built on meta: its
            # tables are computed once it is allocated (computing them here would pull in
            # torch's meta reference ops, and with them torch._dynamo: seconds at start-up)
            self.register_buffer("inv_freq", torch.empty(self.config.rotary_dim // 2,
                                                         device="meta"), persistent=False)
            self.register_buffer("cos_sin", torch.empty(self.max_positions, self.config.head_dim,
                                                        device="meta"), persistent=False)
            return
        inv_freq = rope_inverse_frequencies(self.config, self.kind).to(device)
        if factors is not None:
            inv_freq = inv_freq / factors.float()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        scaling = rope_attention_scaling(self.config, self.kind)
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        identity = self.config.head_dim // 2 - inv_freq.shape[0]  # partial rotary's passed pairs
        if identity:
            cos = torch.cat([cos, cos.new_ones(self.max_positions, identity)], dim=-1)
            sin = torch.cat([sin, sin.new_zeros(self.max_positions, identity)], dim=-1)
        table = torch.cat([cos, sin], dim=-1)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [T, 1, D] for these positions, once per step (shared by all layers)."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(dtype)
        return cos, sin


    def rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [D], float32, of a rotation by `delta` positions (negative: back), for
        keys already in the cache (attention sinks' shift). The angles alone: the attention
        scaling some scalings fold into the table was applied when the keys were written."""
        angles = delta * self.inv_freq.double()
        identity = self.config.head_dim // 2 - angles.shape[0]
        cos = torch.cat([angles.cos(), angles.new_ones(identity)]).float()
        sin = torch.cat([angles.sin(), angles.new_zeros(identity)]).float()
        return torch.cat([cos, cos]), torch.cat([sin, sin])


def rotate_cached_keys(keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor],
                       ) -> torch.Tensor:
    """keys [..., D] (any float dtype, or an int8 or fp8 cache's rows [..., D + 4]) rotated by
    `rotation` (RotaryEmbedding.rotation), in float32, returned as they were stored (quantized
    rows quantized again)."""
    cos, sin = rotation
    rotated = _rotate(kv_as(keys, torch.float32), cos, sin)
    return to_cache_rows(rotated, keys.dtype)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
    """query [T, H, D], key [T, KVH, D] -> rotated (same shapes and dtype)."""
    cos, sin = rotary
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
