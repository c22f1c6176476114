"""How each family's checkpoints describe it: a `FamilyRules` per architecture turns an HF
`config.json` into ModelConfig fields (and back), and tells the GGUF reader what llama.cpp's
converter did to the family (weights/gguf_file.py reads the metadata keys every family shares).

The rules are plain Python, no torch: the API front-end parses configs too. The base class reads
what HF's config classes share; a family subclasses it and overrides what differs (the built-in
ones are in builtin_families.py). A family from another package passes its rules to
`kvserve.models.register_model(..., config_rules=...)` (registry.py); without rules it is read by
the base class, as a Llama-shaped config without Llama's no-window rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError

if TYPE_CHECKING:
    from kvserve.config.model_config import ModelConfig

# RoPE scalings whose tables depend on the pretraining context (HF's original_max_position_
# embeddings, which it moves into the RoPE parameters)
_ORIGINAL_CONTEXT_SCALINGS = ("llama3", "yarn", "longrope")


class FamilyRules:
    """One architecture's config rules. `architecture` is our name (GGUF general.architecture;
    HF model_type unless `hf_model_type` says otherwise)."""

    architecture: str = ""
    hf_model_type: str | None = None  # HF's model_type where it differs (gemma3_text)
    hf_class_name: str = "LlamaForCausalLM"
    tied_by_default = False  # the HF config class's tie_word_embeddings default
    attention_bias_by_default = False
    qk_norm = False  # RMSNorm over each query and key head (no config field says so)
    # every n-th layer full attention, the rest windowed, where a config has a window but no
    # layer_types (older Gemma configs; llama.cpp's default where a GGUF gives no pattern)
    window_pattern: int | None = None
    # HF RoPE scaling names read as others (Phi-3's "su" and "yarn" are LongRoPE)
    rope_type_aliases: dict[str, str] = {}
    original_context_default: int | None = None  # a top-level original_max_position_embeddings
    is_moe = False  # its layers' MLPs are mixtures of experts
    # GGUF: general.architecture where llama.cpp names the family otherwise (qwen2moe; Mixtral
    # is "llama" with an expert count)
    gguf_architecture: str | None = None
    gguf_norm_topk_prob = False  # llama.cpp's choice where the file has no expert_weights_norm
    # GGUF: llama.cpp layer tensor names -> ours where the family differs from Llama's ("{}" in
    # ours: a tensor of every expert, [experts, rows, cols], split into one per expert)
    gguf_layer_names: dict[str, str] = {}
    gguf_permuted_qk = False  # the converter permuted Q/K rows for its interleaved RoPE
    gguf_no_rope_every: int | None = None  # each n-th layer has no RoPE (llama.cpp's step)
    gguf_local_rope_theta: float | None = None  # sliding layers' RoPE base, not in the file

    def __init__(self, architecture: str | None = None):
        if architecture is not None:
            self.architecture = architecture

    # -- HF config.json -----------------------------------------------------------------------

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig's fields from the HF config dict (KeyError: a required field missing)."""
        weight_format = hf_weight_format(hf.get("quantization_config"))
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return {
            "architecture": self.architecture,
            "vocab_size": hf["vocab_size"],
            "hidden_size": hidden,
            "intermediate_size": hf["intermediate_size"],
            "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hidden // heads,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": _hf_rope_theta(hf),
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            # a base model's checkpoint (Qwen3Model's: an embedding model's) has no LM head:
            # read as tied, its head is the embedding, which a pooling runner never uses
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", self.tied_by_default))
            or is_base_model(hf),
            "attention_bias": bool(hf.get("attention_bias", self.attention_bias_by_default)),
            "rope_scaling": self.hf_rope_scaling(hf),
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": eos,
            "sliding_windows": self.hf_sliding_windows(hf),
            "qk_norm": self.qk_norm,
            "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            "local_rope_theta": _hf_local_rope_theta(hf),
            "partial_rotary_factor": _hf_partial_rotary_factor(hf),
            **weight_format,
        }

    def hf_sliding_windows(self, hf: dict[str, Any]) -> tuple[int | None, ...]:
        """Each layer's window: `layer_types` with `sliding_window` (transformers 5.x), or every
        `window_pattern`-th layer full where the config predates layer_types."""
        window, layer_types = hf.get("sliding_window"), hf.get("layer_types")
        layers = hf["num_hidden_layers"]
        if not layer_types and self.window_pattern and window is not None:
            every = hf.get("sliding_window_pattern") or self.window_pattern
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                           for i in range(layers)]
        if not layer_types:
            return ()
        return windows_of_layer_types(layer_types, window, layers)

    def hf_rope_scaling(self, hf: dict[str, Any]) -> dict[str, Any] | None:
        """The global RoPE scaling as HF's config classes standardise it: `type` read as
        `rope_type` (and the family's aliases), original_max_position_embeddings in the dict (a
        top-level one wins, as in HF)."""
        scaling = hf.get("rope_scaling") or _hf_rope_params(hf)
        if not scaling:
            return None
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind in (None, "default"):
            return None
        kind = self.rope_type_aliases.get(kind, kind)
        scaling = dict(scaling, rope_type=kind)
        if kind in _ORIGINAL_CONTEXT_SCALINGS:
            original = hf.get("original_max_position_embeddings", self.original_context_default)
            original = original or scaling.get("original_max_position_embeddings") or hf.get(
                "max_position_embeddings", 2048)
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def to_hf(self, config: ModelConfig) -> dict[str, Any]:
        """The HF `config.json` fields that describe `config` (tests and exports write it)."""
        hf: dict[str, Any] = {
            "model_type": self.hf_model_type or self.architecture,
            "architectures": [self.hf_class_name],
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings,
            "attention_bias": config.attention_bias,
            "hidden_act": config.hidden_act,
            "hidden_activation": config.hidden_act,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
        }
        if config.rope_scaling:
            hf["rope_scaling"] = dict(config.rope_scaling)
            if "original_max_position_embeddings" in config.rope_scaling:  # where HF looks first
                hf["original_max_position_embeddings"] = \
                    config.rope_scaling["original_max_position_embeddings"]
        if config.local_rope_theta is not None:
            hf["rope_parameters"] = {
                "full_attention": dict(config.rope_scaling or {"rope_type": "default"},
                                       rope_theta=config.rope_theta),
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": config.local_rope_theta}}
        if config.partial_rotary_factor != 1.0:
            hf["partial_rotary_factor"] = config.partial_rotary_factor
        hf.update(self.hf_window_fields(config))
        return hf

    def hf_window_fields(self, config: ModelConfig) -> dict[str, Any]:
        """The inverse of `hf_sliding_windows`: layer_types and the one window size."""
        window = one_window_size(config)
        if window is None:
            return {}
        layer_types = ["full_attention" if w is None else "sliding_attention"
                       for w in config.sliding_windows]
        return {"sliding_window": window, "layer_types": layer_types}

    # -- GGUF ---------------------------------------------------------------------------------

    def gguf_fields(self, meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Fields the family's GGUF files imply beyond the shared keys, given those read from
        them (`fields`); `meta` is the file's metadata, `<arch>.` keys included."""
        return {}


def one_window_size(config: ModelConfig) -> int | None:
    """The config's sliding window (HF configs hold one size), None where no layer has one."""
    sizes = {w for w in config.sliding_windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"HF configs hold one sliding window size, not {sorted(sizes)}")
    return sizes.pop() if sizes else None


def windows_of_layer_types(layer_types: list[str], window: int | None,
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
    """Sliding layers' own RoPE base (`rope_parameters.sliding_attention`, or Gemma 3's older
    `rope_local_base_freq`); those layers must be unscaled, as in every Gemma 3 release."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        theta = hf.get("rope_local_base_freq")
        return None if theta is None else float(theta)
    if local.get("rope_type", "default") != "default":
        raise UnsupportedArchitectureError(
            f"RoPE scaling {local['rope_type']!r} on sliding-window layers is not supported")
    return float(local.get("rope_theta", 10000.0))


def _hf_partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The RoPE parameters' partial_rotary_factor, else the config's top-level one (HF's
    order), else 1."""
    factor = _hf_rope_params(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor")
    return float(factor) if factor else 1.0


def is_base_model(hf: dict[str, Any]) -> bool:
    """The config names only base-model classes (`Qwen3Model`, not `...ForCausalLM` nor
    GPT-2's `...LMHeadModel`): the checkpoint holds the decoder without an LM head."""
    names = hf.get("architectures") or []
    return bool(names) and all(isinstance(name, str) and name.endswith("Model")
                               and not name.endswith("LMHeadModel") for name in names)


def hf_weight_format(quantized: Any) -> dict[str, Any]:
    """ModelConfig's fields for an HF checkpoint's `quantization_config`: none for float weights;
    `fp8` with dynamic activation scales and block-wise weight scales (DeepSeek-V3/R1's and
    Qwen3-FP8's: float8_e4m3fn weights, each with a `weight_scale_inv` of one float32 per
    block) is read; any other scheme fails here, naming it, rather than loading codes as
    numbers."""
    if not quantized:
        return {}
    method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
    if method != "fp8":
        raise UnsupportedArchitectureError(
            f"this checkpoint's weights are quantized ({method!r} quantization_config), which "
            "kvserve does not read from HF directories: load a float or block-wise fp8 "
            "checkpoint (and --quantization), or a GGUF conversion of the model")
    block = quantized.get("weight_block_size")
    scheme = quantized.get("activation_scheme", "dynamic")
    fmt = quantized.get("fmt", "e4m3")
    if scheme != "dynamic" or fmt != "e4m3" or not (
            isinstance(block, (list, tuple)) and len(block) == 2 and
            all(isinstance(size, int) and size > 0 for size in block)):
        raise UnsupportedArchitectureError(
            "this fp8 checkpoint's quantization_config (activation_scheme "
            f"{scheme!r}, fmt {fmt!r}, weight_block_size {block!r}) is not one kvserve reads: "
            "it reads e4m3 weights with block-wise scales (weight_block_size [rows, columns]) "
            "and dynamic activation scales, as DeepSeek-V3 and Qwen3-FP8 ship")
    return {"source_weight_type": "fp8", "weight_block_size": tuple(block)}
