"""Build a model for a config and fill it with weights from a ModelSource (or at random).

A GGUF model, once converted, is cached as its own float32 state dict (fused layout): a later load
memory-maps that file and assigns the tensors to the parameters without copying them (float32) or
with one cast (other dtypes).

With a ParallelContext of more than one rank (`parallel=`) the model is the rank's shard: its
pipeline stage's layers, built from `shard_config` for its tensor-parallel slice, filled with
only its tensors and slices (kvserve/weights/sharded.py), quantized slice by slice.
`parallel=None` (or one rank) is the single-process path, unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kvserve.attention import get_attention_backend
from kvserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvserve.distributed.communication import world_barrier
from kvserve.distributed.parallel_state import (
    ParallelContext,
    is_distributed,
    with_layer_partition,
)
from kvserve.distributed.sharding import shard_config, shard_rule
from kvserve.errors import UnsupportedArchitectureError
from kvserve.model_source import ModelSource
from kvserve.models.llama import LlamaForCausalLM
from kvserve.quant import quantize_model, resolve_quantization, use_bf16_panels
from kvserve.weights import cache, load_config, load_hf_named_tensors
from kvserve.weights.hf_dir import safetensors_files
from kvserve.weights.sharded import iter_sharded_safetensors, shard_tensors

logger = logging.getLogger(__name__)

# every supported family runs on the shared layers of models/llama.py, set by its config
_MODEL_CLASSES = {architecture: LlamaForCausalLM for architecture in SUPPORTED_ARCHITECTURES}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_kv_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A KV cache's dtype by name: the activation dtypes, or int8 (quantized rows)."""
    return torch.int8 if dtype in ("int8", torch.int8) else resolve_dtype(dtype)


def _construct_on_meta(config: ModelConfig, attention_backend: str, use_cpu_kernels: bool = True,
                       device: str | torch.device = "cpu",
                       parallel: ParallelContext | None = None):
    # the compiled kernels read CPU memory; other devices run the torch versions of the ops
    use_cpu_kernels = use_cpu_kernels and torch.device(device).type == "cpu"
    if config.architecture not in _MODEL_CLASSES:
        raise UnsupportedArchitectureError(f"No model class for {config.architecture!r}")
    backend = get_attention_backend(attention_backend, use_cpu_kernels)
    with torch.device("meta"):
        return _MODEL_CLASSES[config.architecture](config, backend, parallel)


def _finish(model, dtype: torch.dtype, quantization: str = "none", weights_ready: bool = True):
    """Quantize the projections (from the float32 weights still in place), or lay unquantized
    bf16 ones out for our decode kernel, cast the parameters to dtype (buffers keep theirs: RoPE
    stays float32 as in HF, quantized layers chose their own) and rebuild the RoPE table."""
    quantize_model(model, quantization, dtype, model.kernel_ops, model.parallel)
    if quantization == "none" and weights_ready:
        use_bf16_panels(model, dtype, model.kernel_ops)
    model.quantization = quantization
    model.activation_dtype = dtype
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.model.reset_rotary_tables()
    return model.eval().requires_grad_(False)


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: str = "cpu",
                      attention_backend: str = "torch_ref", use_cpu_kernels: bool = True,
                      parallel: ParallelContext | None = None):
    """Allocate without initialising (weights come next), on the target device and dtype.
    With `parallel`, `config` is the rank's shard config."""
    model = _construct_on_meta(config, attention_backend, use_cpu_kernels, device, parallel)
    model = model.to_empty(device=device)
    model.model.rotary_emb.freq_factors.fill_(1.0)
    return _finish(model, dtype, weights_ready=False)


def _model_from_state(config: ModelConfig, state: dict[str, torch.Tensor], device: str,
                      attention_backend: str, use_cpu_kernels: bool,
                      parallel: ParallelContext | None = None):
    """The model holding `state` as it is (float32 from the weight cache)."""
    model = _construct_on_meta(config, attention_backend, use_cpu_kernels, device, parallel)
    state = {name: tensor.to(device) for name, tensor in state.items() if model.holds(name)}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_model(source: ModelSource, dtype: str | torch.dtype = "float32", device: str = "cpu",
               attention_backend: str = "torch_ref", use_cache: bool = True,
               use_cpu_kernels: bool = True, quantization: str = "none",
               dtype_is_default: bool = False, parallel: ParallelContext | None = None,
               max_model_len: int | None = None):
    """Return (model, config) with the source's weights loaded. `dtype_is_default`: the dtype is
    the machine's default rather than the user's choice, which lets `quantization="auto"` keep a
    4-bit checkpoint 4-bit in float32 (see resolve_quantization). With `parallel` (tp_size > 1)
    every rank calls this together and gets its shard; the config returned is then the rank's
    (`model.config`: its heads, so the KV cache holds only the rank's KV heads).
    `max_model_len`: the longest sequence the engine will serve, if it says (LongRoPE's choice
    of factors, `ModelConfig.max_model_len`)."""
    torch_dtype = resolve_dtype(dtype)
    start = time.perf_counter()
    config = dataclasses.replace(load_config(source, use_cache), max_model_len=max_model_len)
    cached = cache.artifact_path(source.path, "weights.safetensors") \
        if source.format == "gguf" and use_cache else None
    quantization = resolve_quantization(
        quantization, config.source_weight_type, torch_dtype,
        dtype_is_default and _has_fast_low_bit_kernels(device, use_cpu_kernels), device,
        _has_wide_integer_dots(device, use_cpu_kernels))
    if is_distributed(parallel):
        parallel = with_layer_partition(parallel, config, quantization)
        model, how = _load_shard(source, config, cached, device, attention_backend,
                                 use_cpu_kernels, parallel)
    elif cached is not None and cached.is_file():
        from safetensors.torch import load_file

        model = _model_from_state(config, load_file(str(cached)), device, attention_backend,
                                  use_cpu_kernels)
        how = f"from cache {cached}"
    else:
        model = _load_whole(source, config, cached, device, attention_backend, use_cpu_kernels)
        how = f"from {source.path}"
    model = _finish(model, torch_dtype, quantization)
    logger.info("model %s (%s, quantization %s) loaded %s in %.2fs", source.name, torch_dtype,
                quantization, how, time.perf_counter() - start)
    return model, model.config


def _load_whole(source: ModelSource, config: ModelConfig, cached, device: str,
                attention_backend: str, use_cpu_kernels: bool):
    """The float32 model from the checkpoint itself, written to the weight cache if wanted."""
    model = build_empty_model(config, torch.float32, device, attention_backend, use_cpu_kernels)
    model.load_weights(load_hf_named_tensors(source, config).items())
    if cached is not None:
        cache.save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, cached)
    return model


def _load_shard(source: ModelSource, config: ModelConfig, cached, device: str,
                attention_backend: str, use_cpu_kernels: bool, parallel: ParallelContext):
    """This rank's float32 shard. A GGUF is converted into the weight cache once, by rank 0
    while the others wait; then every rank reads its stage's tensors, and its slices of them,
    from the cache (or the HF directory's files) lazily."""
    rank_config = shard_config(config, parallel.tp_size)
    holds = _construct_on_meta(rank_config, attention_backend, use_cpu_kernels, device,
                               parallel).holds
    where = (f"(rank {parallel.rank}: stage {parallel.pp_rank} of {parallel.pp_size}, "
             f"tensor rank {parallel.tp_rank} of {parallel.tp_size})")

    def rule_for(name: str):
        return shard_rule(name, config, parallel.tp_size, parallel.tp_rank)

    if cached is not None:
        # every rank meets at the barrier, whatever it sees on disk: deciding per rank whether
        # the cache exists deadlocked when rank 0 wrote it before a slower rank looked
        if parallel.rank == 0 and not cached.is_file():
            _load_whole(source, config, cached, "cpu", "torch_ref", False)
        world_barrier()
    if cached is not None and cached.is_file():  # fused names, HF layout, float32
        state = dict(iter_sharded_safetensors([cached], rule_for, holds))
        model = _model_from_state(rank_config, state, device, attention_backend,
                                  use_cpu_kernels, parallel)
        return model, f"from cache {cached} {where}"
    model = build_empty_model(rank_config, torch.float32, device, attention_backend,
                              use_cpu_kernels, parallel)
    if source.format == "hf":
        tensors = iter_sharded_safetensors(safetensors_files(source.path), rule_for, holds)
    else:  # a GGUF without the cache: dequantized whole, sliced in memory
        tensors = shard_tensors(load_hf_named_tensors(source, config).items(), rule_for)
    model.load_weights(tensors)
    return model, f"from {source.path} {where}"


def _has_fast_low_bit_kernels(device: str, use_cpu_kernels: bool) -> bool:
    """Our vectorised int4/int8 kernels are loaded (else torch's int4 op, slower than a float32
    GEMV on AVX2, would serve the 4-bit layers)."""
    from kvserve.kernels import get_ops

    return device == "cpu" and get_ops(use_cpu_kernels).int4_linear_fast()


def _has_wide_integer_dots(device: str, use_cpu_kernels: bool) -> bool:
    """Our w4a8 kernels take a whole panel per integer dot product (AVX512-VNNI builds)."""
    from kvserve.kernels import get_ops

    return device == "cpu" and get_ops(use_cpu_kernels).q8_dot_wide()


def random_model(config: ModelConfig, dtype: str | torch.dtype = "float32", seed: int = 0,
                 device: str = "cpu", attention_backend: str = "torch_ref",
                 use_cpu_kernels: bool = True, quantization: str = "none",
                 parallel: ParallelContext | None = None):
    """A model with small random weights (deterministic for a seed), for fast tests. With
    `parallel` (several ranks): this rank's shard of exactly the model one rank gives for
    `config` (the full model is drawn, then sliced)."""
    model = build_empty_model(config, torch.float32, device, attention_backend, use_cpu_kernels)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    if is_distributed(parallel):
        state = dict(shard_tensors(model.state_dict().items(), lambda name: shard_rule(
            name, config, parallel.tp_size, parallel.tp_rank)))
        model = _model_from_state(shard_config(config, parallel.tp_size), state, device,
                                  attention_backend, use_cpu_kernels, parallel)
    return _finish(model, resolve_dtype(dtype), quantization)
