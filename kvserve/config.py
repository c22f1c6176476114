"""Model configuration shared by the weight loaders and the model code.

One frozen dataclass describes the architecture whatever the checkpoint format, so the model
never needs to know whether its weights came from a GGUF file or an HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
QK_NORM_ARCHITECTURES = ("qwen3",)


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

    def __post_init__(self):
        windows = tuple(None if w is None else int(w) for w in self.sliding_windows)
        if any(w is not None and w <= 0 for w in windows):
            raise ValueError(f"sliding windows must be positive, got {windows}")
        if windows and len(windows) != self.num_hidden_layers:
            raise ValueError(f"{len(windows)} sliding windows for {self.num_hidden_layers} layers")
        if all(w is None for w in windows):
            windows = ()
        # normalised (JSON caches hand back lists): frozen, so through object.__setattr__
        object.__setattr__(self, "sliding_windows", windows)

    def sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window, None for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from an HF `config.json` dict."""
        model_type = hf.get("model_type", "")
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
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_hf_rope_scaling(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            sliding_windows=_hf_sliding_windows(hf),
            qk_norm=model_type in QK_NORM_ARCHITECTURES,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` fields that describe this model (used by tests and exports)."""
        hf: dict[str, Any] = {
            "model_type": self.architecture,
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
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        hf.update(self._hf_window_fields())
        return hf

    def _hf_window_fields(self) -> dict[str, Any]:
        """The inverse of `_hf_sliding_windows` for HF's one window size per config."""
        sizes = {w for w in self.sliding_windows if w is not None}
        if len(sizes) > 1:
            raise ValueError(f"HF configs hold one sliding window size, not {sorted(sizes)}")
        window = sizes.pop() if sizes else None
        if self.architecture == "mistral":
            if window is not None and None in self.sliding_windows:
                raise ValueError("HF Mistral windows every layer or none")
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
}


def _hf_sliding_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window as HF transformers builds it for the family (transformers 5.x):
    Llama has none; Mistral windows every layer with `sliding_window` (absent: MistralConfig's
    default 4096; null: none) and ignores `layer_types`; Qwen2 drops `sliding_window` unless
    `use_sliding_window`, and its layers are `layer_types` or else those from index
    `max_window_layers` on (Qwen3 likewise); other families follow `layer_types` where the
    config has one."""
    model_type = hf.get("model_type", "")
    layers = hf["num_hidden_layers"]
    if model_type == "llama":
        return ()
    if model_type == "mistral":
        window = hf.get("sliding_window", 4096)
        return (window,) * layers if window is not None else ()
    if model_type in ("qwen2", "qwen3"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28)
            else "full_attention" for i in range(layers)]
    else:
        window, layer_types = hf.get("sliding_window"), hf.get("layer_types")
        if not layer_types:
            return ()
    return _windows_of_layer_types(layer_types, window, layers)


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


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _hf_rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    return dict(scaling, rope_type=kind)
