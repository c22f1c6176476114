"""Model configuration shared by the weight loaders and the model code.

One frozen dataclass describes the architecture whatever the checkpoint format, so the model
never needs to know whether its weights came from a GGUF file or an HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "smollm3",
                           "phi3")
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3")
# Gemma: norms scale by (1 + weight) in float32, around attention and MLP both (before and after),
# a GeGLU MLP, the embedding scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# HF model_type -> our architecture name (the GGUF one) where they differ
_HF_ARCHITECTURE_NAMES = {"gemma3_text": "gemma3"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# checkpoints that store Q/K/V and gate/up fused, under our own fused names (Phi-3, Phi-4-mini)
FUSED_CHECKPOINT_ARCHITECTURES = ("phi3",)
# families whose HF config windows every layer with `sliding_window` (its default when absent)
_EVERY_LAYER_WINDOW_DEFAULTS = {"mistral": 4096, "phi3": None}
# RoPE scalings whose tables depend on the pretraining context (HF's original_max_position_
# embeddings, which it moves into the RoPE parameters)
_ORIGINAL_CONTEXT_SCALINGS = ("llama3", "yarn", "longrope")
# config classes with a top-level original_max_position_embeddings field, and its default
_ORIGINAL_CONTEXT_DEFAULTS = {"phi3": 4096}


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
        # normalised (JSON caches hand back lists): frozen, so through object.__setattr__
        object.__setattr__(self, "sliding_windows", windows)
        object.__setattr__(self, "rope_layers", rope_layers)

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
        """Build from an HF `config.json` dict."""
        model_type = hf_architecture_name(hf.get("model_type", ""))
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_hf_rope_theta(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_hf_rope_scaling(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            sliding_windows=_hf_sliding_windows(hf),
            qk_norm=model_type in QK_NORM_ARCHITECTURES,
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            rope_layers=tuple(hf.get("no_rope_layers") or ()) if model_type == "smollm3" else (),
            local_rope_theta=_hf_local_rope_theta(hf),
            partial_rotary_factor=_hf_partial_rotary_factor(hf),
            **(gemma_options(model_type, hidden, hf) if model_type in GEMMA_ARCHITECTURES
               else {}),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` fields that describe this model (used by tests and exports)."""
        hf: dict[str, Any] = {
            "model_type": _HF_MODEL_TYPES.get(self.architecture, self.architecture),
            "architectures": [_HF_CLASS_NAMES.get(self.architecture, "LlamaForCausalLM")],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "hidden_activation": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
            if "original_max_position_embeddings" in self.rope_scaling:  # where HF looks first
                hf["original_max_position_embeddings"] = \
                    self.rope_scaling["original_max_position_embeddings"]
        if self.architecture in GEMMA_ARCHITECTURES:
            hf["query_pre_attn_scalar"] = self.scale**-2
            hf["attn_logit_softcapping"] = self.attn_logit_softcapping
            hf["final_logit_softcapping"] = self.final_logit_softcapping
        if self.local_rope_theta is not None:
            hf["rope_parameters"] = {
                "full_attention": dict(self.rope_scaling or {"rope_type": "default"},
                                       rope_theta=self.rope_theta),
                "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_theta}}
        if self.partial_rotary_factor != 1.0:
            hf["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_layers:
            hf["no_rope_layers"] = [int(r) for r in self.rope_layers]
        hf.update(self._hf_window_fields())
        return hf

    def _hf_window_fields(self) -> dict[str, Any]:
        """The inverse of `_hf_sliding_windows` for HF's one window size per config."""
        sizes = {w for w in self.sliding_windows if w is not None}
        if len(sizes) > 1:
            raise ValueError(f"HF configs hold one sliding window size, not {sorted(sizes)}")
        window = sizes.pop() if sizes else None
        if self.architecture in _EVERY_LAYER_WINDOW_DEFAULTS:
            if window is not None and None in self.sliding_windows:
                raise ValueError(f"HF {self.architecture} windows every layer or none")
            return {"sliding_window": window}
        if window is None:
            return {}
        layer_types = ["full_attention" if w is None else "sliding_attention"
                       for w in self.sliding_windows]
        fields: dict[str, Any] = {"sliding_window": window, "layer_types": layer_types}
        if self.architecture in ("qwen2", "qwen3"):
            fields["use_sliding_window"] = True
            fields["max_window_layers"] = layer_types.index("sliding_attention")
        return fields


_HF_CLASS_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
def hf_architecture_name(model_type: str | None) -> str | None:
    """Our architecture name for an HF model_type (the GGUF name where they differ)."""
    return _HF_ARCHITECTURE_NAMES.get(model_type, model_type)


_HF_MODEL_TYPES = {ours: hf for hf, ours in _HF_ARCHITECTURE_NAMES.items()}
# families whose HF config class defaults tie_word_embeddings to true
_TIED_BY_DEFAULT = ("gemma2", "gemma3", "smollm3")


def gemma_options(architecture: str, hidden_size: int, hf: dict[str, Any] | None = None,
                  ) -> dict[str, Any]:
    """The ModelConfig fields every Gemma shares, and the HF config's scale and caps."""
    hf = hf or {}
    scalar = hf.get("query_pre_attn_scalar")
    return {
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": hidden_size**0.5,
        "attention_scale": None if scalar is None else float(scalar) ** -0.5,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }


def _hf_sliding_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window as HF transformers builds it for the family (transformers 5.x):
    Llama has none; Mistral and Phi-3 window every layer with `sliding_window` (absent:
    MistralConfig's default 4096, Phi3Config's none; null: none) and ignore `layer_types`;
    Qwen2 drops `sliding_window` unless `use_sliding_window`, and its layers are `layer_types`
    or else those from index `max_window_layers` on (Qwen3 likewise); other families follow
    `layer_types` where the config has one."""
    model_type = hf.get("model_type", "")
    layers = hf["num_hidden_layers"]
    if model_type == "llama":
        return ()
    if model_type in _EVERY_LAYER_WINDOW_DEFAULTS:
        window = hf.get("sliding_window", _EVERY_LAYER_WINDOW_DEFAULTS[model_type])
        return (window,) * layers if window is not None else ()
    if model_type in ("qwen2", "qwen3"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28)
            else "full_attention" for i in range(layers)]
    else:
        window, layer_types = hf.get("sliding_window"), hf.get("layer_types")
        if not layer_types and model_type in _GEMMA_WINDOW_PATTERNS and window is not None:
            every = hf.get("sliding_window_pattern") or _GEMMA_WINDOW_PATTERNS[model_type]
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                           for i in range(layers)]
        if not layer_types:
            return ()
    return _windows_of_layer_types(layer_types, window, layers)


# Gemma configs from before `layer_types`: every n-th layer is global (HF's and llama.cpp's n)
_GEMMA_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def _windows_of_layer_types(layer_types: list[str], window: int | None,
                            layers: int) -> tuple[int | None, ...]:
    if len(layer_types) != layers:
        raise CorruptModelFileError(
            f"layer_types names {len(layer_types)} layers, the model has {layers}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedArchitectureError(f"layer_types {sorted(unknown)} are not supported "
                                           "(sliding_attention and full_attention are)")
    if "sliding_attention" in layer_types and window is None:
        raise CorruptModelFileError("layer_types names sliding_attention layers but the config "
                                    "sets no sliding_window")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _hf_rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The (global layers') RoPE parameters: Gemma 3 keeps one set per layer type."""
    params = hf.get("rope_parameters") or {}
    return params.get("full_attention") or params if isinstance(params, dict) else {}


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    return float(_hf_rope_params(hf).get("rope_theta", 10000.0))


def _hf_local_rope_theta(hf: dict[str, Any]) -> float | None:
    """Gemma 3's sliding layers' RoPE base (`rope_parameters.sliding_attention`, or the older
    `rope_local_base_freq`); those layers must be unscaled, as in every Gemma 3 release."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        theta = hf.get("rope_local_base_freq")
        return None if theta is None else float(theta)
    if local.get("rope_type", "default") != "default":
        raise UnsupportedArchitectureError(
            f"RoPE scaling {local['rope_type']!r} on sliding-window layers is not supported")
    return float(local.get("rope_theta", 10000.0))


def _hf_rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The global RoPE scaling as HF's config classes standardise it: `type` read as
    `rope_type`, Phi-3's old names "su" and "yarn" as "longrope" (Phi3Config's own mapping),
    and original_max_position_embeddings in the dict (a top-level one wins, as in HF)."""
    scaling = hf.get("rope_scaling") or _hf_rope_params(hf)
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if hf.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"
    scaling = dict(scaling, rope_type=kind)
    if kind in _ORIGINAL_CONTEXT_SCALINGS:
        original = hf.get("original_max_position_embeddings",
                          _ORIGINAL_CONTEXT_DEFAULTS.get(hf.get("model_type")))
        original = original or scaling.get("original_max_position_embeddings") or hf.get(
            "max_position_embeddings", 2048)
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _hf_partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The RoPE parameters' partial_rotary_factor, else the config's top-level one (HF's
    order), else 1."""
    factor = _hf_rope_params(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor")
    return float(factor) if factor else 1.0
