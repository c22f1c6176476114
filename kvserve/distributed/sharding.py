"""The arithmetic of tensor-parallel slices, the rank's view of the config, and pipeline stages'
layer counts. Which slice each weight takes is its layer's own rule (models/layers/linear.py,
embedding.py, from these helpers): attention by heads (rank r holds query heads [r * H / tp,
(r + 1) * H / tp) and the KV heads they read: split evenly when tp divides them, one replicated
head per rank when tp is a multiple of them), the MLP's gate/up by rows, o_proj and down_proj
by columns (each rank's product a partial sum, all-reduced), the embedding and LM head by
vocabulary rows padded to equal shards. A `ShardRule` slices anything indexable: torch tensors
or safetensors' lazy slices, so a rank reads only its bytes from a memory-mapped file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.config import ModelConfig


def validate_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError (naming the numbers) when the model cannot split over tp_size ranks."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp_size}")
    if heads % tp_size:
        raise ValueError(f"the model's {heads} attention heads do not divide over a "
                         f"tensor-parallel size of {tp_size}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"the model's {kv_heads} KV heads and a tensor-parallel size of "
                         f"{tp_size}: one must divide the other")
    if config.intermediate_size % tp_size:
        raise ValueError(f"the model's intermediate size {config.intermediate_size} does not "
                         f"divide over a tensor-parallel size of {tp_size}")


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """One rank's config: its heads, KV heads and MLP width (the same for every rank), so that
    each attention layer's `kv_page_layout` sizes and allocates the rank's own KV."""
    if tp_size == 1:
        return config
    if config.tensor_parallel_size != 1:
        raise ValueError("config is already one rank's shard")
    validate_tensor_parallel(config, tp_size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // tp_size,
        num_key_value_heads=max(1, config.num_key_value_heads // tp_size),
        intermediate_size=config.intermediate_size // tp_size,
        tensor_parallel_size=tp_size,
    )


def kv_head_range(config: ModelConfig, tp_size: int, rank: int) -> tuple[int, int]:
    """The KV heads rank `rank` holds: its share, or the one head its query heads read."""
    return kv_heads_of_rank(config.num_key_value_heads, tp_size, rank)


def kv_heads_of_rank(kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """[first, end) of the model's `kv_heads` KV heads that rank `rank` holds."""
    if tp_size <= kv_heads:
        per_rank = kv_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * kv_heads // tp_size
    return head, head + 1


def vocab_range(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """(first id, end id, padded shard rows): shards of ceil(vocab / tp) rows, the last one
    padded with zero rows so every rank's logits shard has the same width."""
    padded = -(-vocab_size // tp_size)
    start = min(vocab_size, rank * padded)
    return start, min(vocab_size, start + padded), padded


@dataclass(frozen=True)
class ShardRule:
    """Take `ranges` along `dim` (concatenated, in order); pad dim to `pad_to` rows with zeros."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int | None = None


def take_shard(tensor: Any, rule: ShardRule | None) -> torch.Tensor:
    """Apply `rule` to a torch tensor or a safetensors slice (read lazily: only these bytes);
    no rule: the tensor as given (a slice read whole)."""
    if rule is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    pieces = []
    for start, end in rule.ranges:
        index = (slice(start, end),) if rule.dim == 0 else (slice(None), slice(start, end))
        pieces.append(tensor[index])
    if len(pieces) > 1:
        shard = torch.cat(pieces, dim=rule.dim)
    elif isinstance(tensor, torch.Tensor):  # a view must not keep the whole alive, nor stay
        shard = pieces[0].clone(memory_format=torch.contiguous_format)  # strided
    else:  # safetensors read it into a tensor of its own
        shard = pieces[0]
    if rule.pad_to is not None and shard.shape[rule.dim] < rule.pad_to:
        padding = list(shard.shape)
        padding[rule.dim] = rule.pad_to - shard.shape[rule.dim]
        shard = torch.cat([shard, shard.new_zeros(padding)], dim=rule.dim)
    return shard


# Pipeline stages -------------------------------------------------------------------------------

# vLLM's name for the same override: comma-separated layer counts per stage, e.g. "19,11"
PP_LAYER_PARTITION_ENV = "KVSERVE_PP_LAYER_PARTITION"


def validate_pipeline_parallel(config: ModelConfig, pp_size: int) -> None:
    """Raise ValueError when the model's layers cannot make pp_size stages of at least one."""
    if pp_size < 1:
        raise ValueError(f"pipeline-parallel size must be at least 1, got {pp_size}")
    if config.num_hidden_layers < pp_size:
        raise ValueError(f"the model's {config.num_hidden_layers} layers cannot make "
                         f"{pp_size} pipeline stages")


def stage_layer_counts(config: ModelConfig, pp_size: int, head_cost: float = 1.0) -> list[int]:
    """Decoder layers per stage, balancing the weight bytes each stage reads per token: the last
    stage also runs the LM head (for SmolLM2-135M as many weights as 8 layers), so it takes
    fewer. `head_cost`: bytes per LM-head weight over bytes per layer weight (2 when 4-bit
    layers sit beside the int8 head: `head_cost_for`). KVSERVE_PP_LAYER_PARTITION overrides (it
    must sum to the model's layers)."""
    import os

    layers = config.num_hidden_layers
    validate_pipeline_parallel(config, pp_size)
    override = os.environ.get(PP_LAYER_PARTITION_ENV)
    if override:
        counts = [int(part) for part in override.split(",")]
        if len(counts) != pp_size or sum(counts) != layers or min(counts) < 1:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}={override!r} must be {pp_size} "
                             f"positive layer counts summing to {layers}")
        return counts
    if pp_size == 1:
        return [layers]
    # per rank: a tensor-parallel shard config holds 1/tp of each layer, and the LM head is
    # split by vocabulary rows the same way
    head_rows = config.vocab_size / config.tensor_parallel_size
    head = head_cost * head_rows * config.hidden_size / max(1, _layer_weights(config))
    share = (layers + head) / pp_size  # in layers' worth of weight bytes per stage
    last = max(1, min(layers - (pp_size - 1), round(share - head)))
    rest = layers - last
    counts = [rest // (pp_size - 1) + (1 if stage < rest % (pp_size - 1) else 0)
              for stage in range(pp_size - 1)]
    return counts + [last]


def head_cost_for(quantization: str) -> float:
    """Bytes per LM-head weight over bytes per decoder-layer weight: every quantized mode keeps
    the head int8 (~1.06 bytes a weight), so only 4-bit layers (~0.53) make it dearer."""
    return 2.0 if quantization in ("int4", "w4a8") else 1.0


def stage_layer_range(counts: list[int], pp_rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage pp_rank holds, for per-stage `counts`."""
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def _layer_weights(config: ModelConfig) -> int:
    hidden = config.hidden_size
    attention = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    return attention + 3 * hidden * config.intermediate_size
