"""Read GGUF files: metadata -> ModelConfig, tensors -> HF-named float32 arrays.

We map llama.cpp tensor names to HF names so one `load_weights` serves both formats, and undo the
Q/K row permutation llama.cpp's converter applies to Llama-style models (it turns HF's rotate-half
RoPE layout into the interleaved one llama.cpp computes with).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.config import FamilyRules, ModelConfig, architecture_of_gguf, family_rules
from kvserve.config.registry import moe_gguf_architectures
from kvserve.errors import (
    CorruptModelFileError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from kvserve.weights.gguf_reader import GGUFFile

# GGUF arrays we never need as Python lists when reading the model config.
_BULKY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# LongRoPE's factor sets: llama.cpp stores them as tensors, we read them into the config
_LONGROPE_TENSORS = {"long_factor": "rope_factors_long.weight",
                     "short_factor": "rope_factors_short.weight"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def open_gguf(path: Path) -> GGUFFile:
    """Open a GGUF file (gguf_reader.py), turning parse failures into CorruptModelFileError."""
    try:
        return GGUFFile(path)
    except Exception as exc:  # ValueError, struct.error, UnicodeDecodeError, ...
        raise CorruptModelFileError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}). "
            "Re-download or re-convert it."
        ) from exc


def read_metadata(reader: GGUFFile, include_bulky: bool = False) -> dict[str, Any]:
    """All key/value metadata as Python values (tokenizer arrays only when asked)."""
    return {key: value for key, value in reader.metadata.items()
            if include_bulky or key not in _BULKY_KEYS}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Translate llama.cpp's `<arch>.*` keys into our ModelConfig."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise CorruptModelFileError("GGUF file has no general.architecture key")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise CorruptModelFileError(f"GGUF file lacks required key {full!r}")
        return meta[full]

    experts = int(meta.get(f"{arch}.expert_count") or 0)
    rules = family_rules(architecture_of_gguf(arch, experts > 0))
    if experts and not rules.is_moe:
        raise UnsupportedArchitectureError(
            f"this GGUF file's {arch} model is a mixture of {experts} experts, which kvserve "
            f"does not implement for {arch} (it does for "
            f"{', '.join(moe_gguf_architectures())})")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    vocab = meta.get(f"{arch}.vocab_size", meta.get("kvserve.embedding_rows"))
    if vocab is None:
        raise CorruptModelFileError(f"GGUF file lacks {arch}.vocab_size")
    layers = int(need("block_count"))
    fields = dict(
        architecture=rules.architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_scaling(meta, arch),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        sliding_windows=_sliding_windows(meta, arch, layers, rules),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_layers=_rope_layers(rules, layers),
        local_rope_theta=rules.gguf_local_rope_theta,
        partial_rotary_factor=_partial_rotary_factor(rotary, head_dim),
        **(_moe_fields(meta, arch, rules, experts, layers) if experts else {}),
    )
    return ModelConfig(**{**fields, **rules.gguf_fields(meta, fields)})


def _moe_fields(meta: dict[str, Any], arch: str, rules: FamilyRules, experts: int,
                layers: int) -> dict[str, Any]:
    """`<arch>.expert_*` keys as ModelConfig's MoE fields: the experts' MLP width (Mixtral's
    is feed_forward_length), whether the top k renormalise (llama.cpp's per-family choice
    where the file has no expert_weights_norm), leading dense layers."""
    dense = int(meta.get(f"{arch}.leading_dense_block_count") or 0)
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(meta.get(f"{arch}.expert_feed_forward_length")
                                     or meta[f"{arch}.feed_forward_length"]),
        "shared_expert_intermediate_size":
            int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm",
                                        rules.gguf_norm_topk_prob)),
        "moe_layers": tuple(i >= dense for i in range(layers)) if dense else (),
    }


def _rope_layers(rules: FamilyRules, layers: int) -> tuple[bool, ...]:
    every = rules.gguf_no_rope_every
    return tuple((i + 1) % every != 0 for i in range(layers)) if every else ()


def _sliding_windows(meta: dict[str, Any], arch: str, layers: int,
                     rules: FamilyRules) -> tuple[int | None, ...]:
    """`<arch>.attention.sliding_window` (0 or absent: none) on the layers its
    `sliding_window_pattern` marks, as llama.cpp reads them: an array of bools (true: windowed),
    or an integer n (every layer but each n-th, 0: all); no pattern: every layer."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if window <= 0:
        return ()
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", rules.window_pattern)
    if pattern is None:
        return (window,) * layers
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise CorruptModelFileError(f"{arch}.attention.sliding_window_pattern has "
                                        f"{len(pattern)} entries for {layers} layers")
        return tuple(window if windowed else None for windowed in pattern)
    every = int(pattern)
    return tuple(window if every == 0 or i % every < every - 1 else None for i in range(layers))


def _partial_rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """HF's partial_rotary_factor for llama.cpp's rope.dimension_count: rotary_dim / head_dim,
    or the next float up where int(head_dim * factor) (HF's rotary_dim) would truncate it to
    one less (30 / 44, for one)."""
    factor = rotary_dim / head_dim
    if int(head_dim * factor) != rotary_dim:
        factor = math.nextafter(factor, 2.0)
    return factor


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """`<arch>.rope.scaling.*` as HF's RoPE parameters. llama.cpp's Llama 3 scaling is not
    here: its converter bakes it into a `rope_freqs` tensor (RotaryEmbedding.freq_factors);
    nor are Phi-3's LongRoPE factor sets, which are tensors (`load_gguf_config` reads them)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if f"kvserve.{_LONGROPE_TENSORS['long_factor']}" in meta:  # Phi-3 writes no scaling type
        kind = "longrope"
    if kind in (None, "none"):
        return None
    key = f"{arch}.rope.scaling."
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[key + "factor"])}
    if kind == "yarn":
        return _yarn_scaling(meta, key)
    if kind == "longrope":
        return _longrope_scaling(meta, key)
    raise UnsupportedArchitectureError(f"RoPE scaling {kind!r} in GGUF files is not supported")


def _yarn_scaling(meta: dict[str, Any], key: str) -> dict[str, Any]:
    """YaRN as llama.cpp's converter writes HF's parameters: factor, the pretraining context and,
    where the checkpoint set them, attention_factor and the two betas."""
    scaling = {"rope_type": "yarn", "factor": float(meta[key + "factor"]),
               "original_max_position_embeddings": int(meta[key + "original_context_length"])}
    optional = {"attention_factor": "yarn_attn_factor", "beta_fast": "yarn_beta_fast",
                "beta_slow": "yarn_beta_slow"}
    for name, gguf_name in optional.items():
        if key + gguf_name in meta:
            scaling[name] = float(meta[key + gguf_name])
    return scaling


def _longrope_scaling(meta: dict[str, Any], key: str) -> dict[str, Any]:
    """LongRoPE: both factor sets (tensors), the pretraining context, and the attention factor
    llama.cpp's converter computed (HF's default from the two contexts) where it wrote one."""
    factors = {name: meta.get(f"kvserve.{tensor}") for name, tensor in _LONGROPE_TENSORS.items()}
    if None in factors.values() or key + "original_context_length" not in meta:
        raise CorruptModelFileError("a LongRoPE GGUF needs rope_factors_long, rope_factors_short "
                                    "and rope.scaling.original_context_length")
    scaling = {"rope_type": "longrope", **factors,
               "original_max_position_embeddings": int(meta[key + "original_context_length"])}
    if key + "attn_factor" in meta:
        scaling["attention_factor"] = float(meta[key + "attn_factor"])
    return scaling


def load_gguf_config(path: Path, check_architecture=None) -> ModelConfig:
    """The file's ModelConfig; `check_architecture(name, where)` first (see
    weights.loader.load_config)."""
    reader = open_gguf(path)
    if check_architecture is not None:
        arch = reader.metadata.get("general.architecture")
        experts = reader.metadata.get(f"{arch}.expert_count") or 0
        check_architecture(architecture_of_gguf(arch, experts > 0), str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    meta = read_metadata(reader)
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None:  # Gemma 3's files have no <arch>.vocab_size: the table's rows
        meta["kvserve.embedding_rows"] = int(embedding.shape[-1])
    for tensor in reader.tensors:  # LongRoPE's factor sets (a few dozen floats each)
        if tensor.name in _LONGROPE_TENSORS.values():
            meta[f"kvserve.{tensor.name}"] = dequantize_tensor(tensor).tolist()
    config = config_from_metadata(meta, set(types))
    # the first layer's query projection says how the file stores its projections (MLA with
    # q LoRA has no attn_q: its first half)
    query = types.get("blk.0.attn_q.weight") or types.get("blk.0.attn_q_a.weight")
    return dataclasses.replace(config, source_weight_type=query)


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """llama.cpp name -> HF name, or None for tensors we do not use. A name with "{}" is a
    tensor of every expert ([experts, rows, cols]), each expert's named by its index."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match:
        name = family_rules(architecture).gguf_layer_names.get(match.group(2)) or \
            _LAYER_NAMES.get(match.group(2))
        return f"model.layers.{match.group(1)}.{name}" if name else None
    return None


def permuted_heads(name: str, config: ModelConfig) -> int:
    """Heads of a Q or K projection llama.cpp permuted for its interleaved RoPE, else 0."""
    if not family_rules(config.architecture).gguf_permuted_qk:
        return 0
    if ".q_proj." in name:
        return config.num_attention_heads
    return config.num_key_value_heads if ".k_proj." in name else 0


def dequantize_tensor(tensor) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in numpy (row-major, HF orientation)."""
    from gguf import GGMLQuantizationType, quants

    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost-first
    try:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.asarray(tensor.data)
        else:
            array = quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise UnsupportedQuantizationError(
            f"Tensor {tensor.name!r} uses quantization {qtype.name}, which the gguf package "
            "cannot dequantize. Re-quantize the model to one of F32, F16, BF16, Q8_0, Q4_0, "
            "Q4_1, Q5_0, Q5_1, Q2_K..Q6_K or an IQ type."
        ) from exc
    except Exception as exc:
        raise CorruptModelFileError(
            f"Tensor {tensor.name!r} ({qtype.name}) could not be decoded: {exc}"
        ) from exc
    try:
        return np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    except ValueError as exc:
        raise CorruptModelFileError(
            f"Tensor {tensor.name!r} has {array.size} values, expected shape {shape}"
        ) from exc


def unpermute_rope_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row interleave of Q/K projections (rows 0,2,4,..,1,3,5..)."""
    rows = array.shape[0]
    rest = array.shape[1:]
    half = rows // num_heads // 2
    return array.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
