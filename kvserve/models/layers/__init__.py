"""The layer classes families are composed of: projections that carry their loader, shard
rule and quantization (linear.py), self-attention over the paged cache (attention.py), the
gated MLP, RMSNorm, RoPE tables, the token embedding and LM head, the op set layers run on
(ops.py), the shared decoder stack (decoder.py) and the causal-LM base with loading by
checkpoint name (causal_lm.py)."""

from kvserve.models.layers.norm import RMSNorm
from kvserve.models.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    rotary_head_order,
    rotate_cached_keys,
)

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary", "rotary_head_order",
           "rotate_cached_keys"]
