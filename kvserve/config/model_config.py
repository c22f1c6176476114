"""Model configuration shared by the weight loaders and the model code.

One frozen dataclass describes the architecture whatever the checkpoint format, so the model
never needs to know whether its weights came from a GGUF file or an HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.config.registry import architecture_of_hf_model_type, family_rules
from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError

# gated MLP activations: SwiGLU, GeGLU, and gpt-oss's clamped SwiGLU (vLLM's "swigluoai")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swigluoai")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # How the checkpoint stores its projection weights (a GGUF type name such as "Q4_1", or a
    # torch dtype name); picks the default quantization (EngineConfig.quantization "auto").
    source_weight_type: str | None = field(default=None, compare=False)
    # An fp8 checkpoint's (source_weight_type "fp8") block of weights sharing one scale:
    # (rows, columns), DeepSeek-V3's (128, 128)
    weight_block_size: tuple[int, int] | None = field(default=None, compare=False)
    # > 1: this config describes one tensor-parallel rank's shard (kvserve/distributed/
    # sharding.py): num_attention_heads, num_key_value_heads and intermediate_size are the rank's,
    # so the KV cache and the projections are sized for it; vocab_size stays the model's.
    tensor_parallel_size: int = 1
    # Per decoder layer, its attention window (None: full attention): a query at position p sees
    # keys at positions k with p - k < window, as HF's `sliding_window` mask. Empty when no layer
    # has one. Read per family as HF transformers does (`_hf_sliding_windows`).
    sliding_windows: tuple[int | None, ...] = ()
    # RMSNorm over each query and key head before RoPE (Qwen3; Gemma 3), weights of head_dim.
    qk_norm: bool = False
    # Gemma: each norm scales by (norm_weight_offset + weight), computed in float32 (HF's
    # Gemma RMSNorm; 0: Llama's weight * dtype(normalised)).
    norm_weight_offset: float = 0.0
    # Gemma 2/3: norms after attention and after the MLP too (HF's post_attention_layernorm
    # then normalises the attention output; pre_feedforward_layernorm the MLP's input).
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # the MLP's gate activation: one of ACTIVATIONS
    embedding_multiplier: float | None = None  # Gemma: sqrt(hidden); None: 1
    attention_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5; None: head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits likewise
    # Gemma 3: the RoPE base of sliding-window layers (rope_theta and rope_scaling are then the
    # full-attention layers'); None: every layer uses rope_theta.
    local_rope_theta: float | None = None
    # Per decoder layer, whether it applies RoPE (SmolLM3 skips every fourth); empty: all do.
    rope_layers: tuple[bool, ...] = ()
    # Phi-4-mini: RoPE rotates only the first `rotary_dim` = int(head_dim * factor) dims of each
    # query and key head (rotate-half within them); the rest pass through (HF's and vLLM's name).
    partial_rotary_factor: float = 1.0
    # Mixtures of experts (0: every layer's MLP is dense). Each token goes to
    # `num_experts_per_tok` of `num_experts` routed experts (softmax over the router's logits,
    # the top k, renormalised to sum to 1 if `norm_topk_prob`), each a gated MLP of
    # `moe_intermediate_size`; `shared_expert_intermediate_size` > 0 adds an expert every token
    # takes, scaled by a sigmoid gate (Qwen2-MoE). `moe_layers`: per decoder layer, whether its
    # MLP is the mixture (empty: every layer's); the others are dense of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    # OLMoE: queries, keys and values clamped to [-clip_qkv, clip_qkv] after the projections
    # (and its QK-norm); None: not clamped
    clip_qkv: float | None = None
    # gpt-oss: a bias on the attention output projection too (attention_bias is Q/K/V's), a
    # learned sink logit per query head joining each attention softmax, a bias on the router
    # and on every expert projection, and the "swigluoai" activation's constants: gate clamped
    # above at swiglu_limit, up to +-swiglu_limit, out = (up + 1) * gate * sigmoid(alpha * gate)
    attention_output_bias: bool = False
    attention_sinks: bool = False
    moe_router_bias: bool = False
    moe_expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek's mixtures: "sigmoid" router scores (V3) or "softmax" (the others); the experts
    # in `moe_groups` groups, a token's top k taken from its `moe_topk_groups` best groups (a
    # group's score: V3 the sum of its two best, V2 its best); `moe_correction_bias`: a
    # per-expert bias added to the scores for the choice only (V3's e_score_correction_bias);
    # the weights times `routed_scaling_factor`; the shared expert ungated where
    # `shared_expert_gated` is false (DeepSeek's `shared_experts`, n_shared_experts of them).
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    # DeepSeek's multi-head latent attention (MLA, kv_lora_rank > 0): queries from q_proj, or
    # through the low-rank q_a_proj / RMSNorm / q_b_proj where q_lora_rank > 0; each token's keys
    # and values from one latent of kv_lora_rank (RMSNorm'd) and one RoPE key of
    # qk_rope_head_dim shared by every head, which is all the cache keeps; per head
    # qk_nope_head_dim unrotated query/key dims and v_head_dim value dims. head_dim is then the
    # RoPE part's (the table's width); `rope_interleave`: RoPE over interleaved pairs (V3's).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3's multi-token prediction: next-token-prediction modules after the decoder
    # layers (checkpoint layers num_hidden_layers..), which speculative decoding's `mtp` method
    # runs as a proposer (kvserve/spec_decode/mtp.py); the model itself never runs them
    num_nextn_predict_layers: int = 0
    # The longest sequence the engine serves (EngineConfig.max_model_len; None: the model's
    # context). A runtime choice, not the checkpoint's: LongRoPE picks its factor set by it, once.
    max_model_len: int | None = field(default=None, compare=False)

    def __post_init__(self):
        windows = tuple(None if w is None else int(w) for w in self.sliding_windows)
        if any(w is not None and w <= 0 for w in windows):
            raise ValueError(f"sliding windows must be positive, got {windows}")
        if windows and len(windows) != self.num_hidden_layers:
            raise ValueError(f"{len(windows)} sliding windows for {self.num_hidden_layers} layers")
        if all(w is None for w in windows):
            windows = ()
        rope_layers = tuple(bool(r) for r in self.rope_layers)
        if rope_layers and len(rope_layers) != self.num_hidden_layers:
            raise ValueError(f"{len(rope_layers)} RoPE flags for {self.num_hidden_layers} layers")
        if all(rope_layers):
            rope_layers = ()
        rotary = self.rotary_dim
        if rotary <= 0 or rotary > self.head_dim or rotary % 2:
            raise UnsupportedArchitectureError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives {rotary} rotary dims "
                f"of {self.head_dim}: they must be even, between 2 and head_dim")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"activation {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
        moe_layers = self._checked_moe_layers()
        # normalised (JSON caches hand back lists): frozen, so through object.__setattr__
        object.__setattr__(self, "sliding_windows", windows)
        object.__setattr__(self, "rope_layers", rope_layers)
        object.__setattr__(self, "moe_layers", moe_layers)

    def _checked_moe_layers(self) -> tuple[bool, ...]:
        layers = tuple(bool(m) for m in self.moe_layers)
        if not self.num_experts:
            if any(layers):
                raise ValueError("moe_layers names mixture-of-experts layers of a model with "
                                 "no experts")
            return ()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CorruptModelFileError(
                f"{self.num_experts_per_tok} experts per token of {self.num_experts}")
        if self.moe_intermediate_size <= 0:
            raise CorruptModelFileError("a mixture of experts needs moe_intermediate_size")
        if layers and len(layers) != self.num_hidden_layers:
            raise ValueError(f"{len(layers)} MoE flags for {self.num_hidden_layers} layers")
        if self.moe_scoring not in ("softmax", "sigmoid"):
            raise UnsupportedArchitectureError(
                f"router scoring {self.moe_scoring!r} is not supported (softmax, sigmoid are)")
        if self.num_experts % self.moe_groups or not 0 < self.moe_topk_groups <= self.moe_groups:
            raise CorruptModelFileError(
                f"{self.num_experts} experts in {self.moe_groups} groups, the best "
                f"{self.moe_topk_groups} of them taken")
        return () if all(layers) else layers

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is the mixture of experts."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    def sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window, None for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def layer_rope(self, layer: int) -> str:
        """Which RoPE table layer `layer` uses: "global" (rope_theta, rope_scaling), "local"
        (local_rope_theta, unscaled: Gemma 3's sliding layers) or "none" (no rotation)."""
        if self.rope_layers and not self.rope_layers[layer]:
            return "none"
        if self.local_rope_theta is not None and self.sliding_window(layer):
            return "local"
        return "global"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates, as HF computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def scale(self) -> float:
        """The attention score scale."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from an HF `config.json` dict, by its family's rules (config/families.py)."""
        architecture = architecture_of_hf_model_type(hf.get("model_type", ""))
        return cls(**family_rules(architecture).from_hf(hf))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` fields that describe this model (used by tests and exports)."""
        return family_rules(self.architecture).to_hf(self)
