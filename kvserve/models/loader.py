"""Build a model for a config and fill it with weights from a ModelSource (or at random).

The family's model class comes from the registry (models/registry.py) and is built on the meta
device, then allocated: only what the layers keep exists (a projection converted to int4 holds
its panels, never a float32 copy of the model). Checkpoint tensors then stream through the
model's loaders one at a time, each projection converting itself when its last part arrives.

A GGUF is read from its memory map tensor by tensor, block-quantized tensors as the file stores
them (weights/quantized_rows.py): kept so by `gguf` (the file's own numbers and bits), or
dequantized one tensor at a time by a converting method. Nothing is written to the cache
directory. With a ParallelContext of more than one rank (`parallel=`) the model is the rank's
shard: its pipeline stage's layers, each taking its tensor-parallel slice of the tensors it is
handed (lazy safetensors slices and GGUF rows: a rank reads only its bytes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Iterable, Iterator

import torch

from kvserve.attention import get_attention_backend
from kvserve.config import ModelConfig
from kvserve.kernels import get_ops
from kvserve.kernels.reference import KV_ROW_DTYPES, is_row_quantized
from kvserve.distributed.parallel_state import (
    ParallelContext,
    is_distributed,
    with_layer_partition,
)
from kvserve.errors import InsufficientMemoryError
from kvserve.memory import available_memory_bytes, check_fits
from kvserve.model_source import ModelSource
from kvserve.models.registry import check_architecture, model_class_for
from kvserve.quant import QuantPolicy, pack_cache, resolve_quantization
from kvserve.quant.pack_cache import PackCache
from kvserve.weights import gguf_file, gguf_stored
from kvserve.weights import load_config as read_config
from kvserve.weights.fp8_checkpoint import tensor_dtypes, iter_fp8_checkpoint
from kvserve.weights.hf_dir import safetensors_files, with_model_prefix
from kvserve.weights.sharded import iter_safetensors

logger = logging.getLogger(__name__)

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
    """A KV cache's dtype by name (as `reference.kv_dtype_name` writes it, or
    `--kv-cache-dtype`'s): the activation dtypes, or quantized rows (int8, fp8 / fp8_e4m3)."""
    if isinstance(dtype, str) and dtype in KV_ROW_DTYPES:
        return KV_ROW_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and is_row_quantized(dtype):
        return dtype
    return resolve_dtype(dtype)


def load_config(source: ModelSource, use_cache: bool = True) -> ModelConfig:
    """The source's config, once the registry knows its family (an unsupported architecture
    fails here, naming the ones kvserve has, before anything else is parsed)."""
    return read_config(source, use_cache, check_architecture)


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
                attention_backend: str = "torch_ref", use_cpu_kernels: bool = True,
                quantization: str = "none", parallel: ParallelContext | None = None,
                source_types: dict[str, str] | None = None, pack_cache=None):
    """The family's model for `config` (the whole model's; with `parallel`, this rank's share
    is built), allocated on `device` in `dtype`, awaiting `load_weights`. `source_types`: how
    the checkpoint stores each tensor (a GGUF's block types), which `gguf` keeps, packed for
    our kernels or found so in `pack_cache` (quant/pack_cache.py)."""
    # the compiled kernels read CPU memory; other devices run the torch versions of the ops
    use_cpu_kernels = use_cpu_kernels and torch.device(device).type == "cpu"
    backend = get_attention_backend(attention_backend, use_cpu_kernels)
    # unquantized projections run on the backend's op set (bf16 panels with the compiled
    # kernels only); quantized ones need our kernels whatever path attends
    kernels = getattr(backend, "ops", None) if quantization == "none" \
        else get_ops(use_cpu_kernels)
    quant = QuantPolicy(quantization, dtype, kernels, parallel, source_types, pack_cache)
    with torch.device("meta"):
        model = model_class_for(config.architecture)(config, backend, parallel, quant)
    allocate_parameters(model, dtype, device)
    model.model.rotary_emb.freq_factors.fill_(1.0)
    model.model.reset_rotary_tables()
    model.quantization = quantization
    model.activation_dtype = dtype
    return model.eval().requires_grad_(False)


def allocate_parameters(model: torch.nn.Module, dtype: torch.dtype, device) -> None:
    """Give a model built on meta real (uninitialised) storage: parameters in `dtype`, buffers
    in their own. Factories with explicit shapes, not `to_empty`: its `empty_like` on meta
    tensors goes through torch's Python reference ops and imports sympy (~1-2 s at start-up)."""
    allocated: dict[int, torch.nn.Parameter] = {}  # a parameter two modules share stays one
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in allocated:
                allocated[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device=device),
                    requires_grad=param.requires_grad)
            module._parameters[name] = allocated[id(param)]
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype,
                                                    device=device)


def load_model(source: ModelSource, dtype: str | torch.dtype = "float32", device: str = "cpu",
               attention_backend: str = "torch_ref", use_cache: bool = True,
               use_cpu_kernels: bool = True, quantization: str = "none",
               dtype_is_default: bool = False, parallel: ParallelContext | None = None,
               max_model_len: int | None = None, reserve_bytes: int = 0):
    """Return (model, config) with the source's weights loaded. `dtype_is_default`: the dtype is
    the machine's default rather than the user's choice, which lets `quantization="auto"` keep a
    4-bit checkpoint 4-bit in float32 (see resolve_quantization). With `parallel` (tp_size > 1)
    every rank calls this together and gets its shard; the config returned is then the rank's
    (`model.config`: its heads, so the KV cache holds only the rank's KV heads).
    `max_model_len`: the longest sequence the engine will serve, if it says (LongRoPE's choice
    of factors, `ModelConfig.max_model_len`). `reserve_bytes`: memory the caller will need
    beside the weights (its share of the KV cache); weights and reserve that cannot fit in the
    available memory raise InsufficientMemoryError before anything is read."""
    torch_dtype = resolve_dtype(dtype)
    start = time.perf_counter()
    config = dataclasses.replace(load_config(source, use_cache), max_model_len=max_model_len)
    quantization = resolve_quantization(
        quantization, config.source_weight_type, torch_dtype,
        dtype_is_default and _has_fast_low_bit_kernels(device, use_cpu_kernels), device)
    if is_distributed(parallel):
        parallel = with_layer_partition(parallel, config, quantization)
    reader = gguf_file.open_gguf(source.path) if source.format == "gguf" else None
    source_types = _source_types(source, reader, config)
    mapped = False
    if torch.device(device).type == "cpu":
        kernels = None if quantization == "none" else get_ops(use_cpu_kernels)  # as built
        mapped = _check_weights_fit(
            source, config, QuantPolicy(quantization, torch_dtype, kernels, parallel,
                                        source_types),
            parallel, reserve_bytes, _packs_stored_weights(source, quantization, parallel))
    cache = _pack_cache(source, quantization, parallel, device, mapped)
    model = build_model(config, torch_dtype, device, attention_backend, use_cpu_kernels,
                        quantization, parallel, source_types, cache)
    built = time.perf_counter()
    model.load_weights(_on_device(_checkpoint_tensors(source, reader, config, parallel),
                                  device))
    del reader  # the file's map goes with the last tensor that still views it
    logger.info("model %s (%s, quantization %s) from %s: config and build %.2fs, weights "
                "%.2fs%s", source.name, torch_dtype, quantization, source.path, built - start,
                time.perf_counter() - built, _pack_cache_note(cache))
    if cache is not None:
        cache.save()
    return model, model.config


def _packs_stored_weights(source: ModelSource, quantization: str,
                          parallel: ParallelContext | None) -> bool:
    """Whether this load packs a GGUF's blocks as stored in one process (what the packed-panel
    cache holds, and what can be served from its map)."""
    return source.format == "gguf" and quantization == "gguf" and not is_distributed(parallel)


def _pack_cache(source: ModelSource, quantization: str, parallel: ParallelContext | None,
                device, mapped: bool = False) -> PackCache | None:
    """The GGUF's packed-panel cache where a load packs them (one process holding the whole
    model on the CPU; ranks pack their shards afresh). `mapped`: the weights do not fit in
    memory: every run is written at once and served from the file's map (whatever the file's
    size or KVSERVE_PACK_CACHE)."""
    if not _packs_stored_weights(source, quantization, parallel) or \
            torch.device(device).type != "cpu":
        return None
    if mapped:
        return PackCache(source.path, spill=True)
    return PackCache(source.path) if pack_cache.enabled(source.path) else None


def _pack_cache_note(cache: PackCache | None) -> str:
    if cache is None:
        return ""
    if cache.hits:
        return f" ({cache.hits} packed runs mapped from {cache.data_path})"
    if cache.spill is not None:
        return f" (beyond memory: packed into {cache.data_path}, served from its map)"
    return f" (packed; being written to {cache.data_path})" if cache.packed else ""


def estimate_weight_bytes(config: ModelConfig, policy: QuantPolicy,
                          parallel: ParallelContext | None = None) -> int:
    """About how many bytes of weights this rank holds once loaded (`QuantPolicy.
    resident_bytes` per checkpoint tensor; a rank's share of a sharded model). A tied LM head
    in a converting mode is a second, int8, copy of the embedding."""
    total = 0.0
    shapes = _full_checkpoint_shapes(config, "torch_ref")
    for name, shape in shapes.items():
        numel = math.prod(shape)
        projection = len(shape) == 2 and name != "model.embed_tokens.weight"
        total += policy.resident_bytes(name, numel, projection)
    if config.tie_word_embeddings and policy.mode not in ("none", "gguf"):
        total += config.vocab_size * config.hidden_size
    world = 1 if parallel is None else parallel.tp_size * parallel.pp_size
    return int(total / world)


def _check_weights_fit(source: ModelSource, config: ModelConfig, policy: QuantPolicy,
                       parallel: ParallelContext | None, reserve_bytes: int,
                       can_map: bool = False) -> bool:
    """InsufficientMemoryError where weights and reserve cannot fit; True where they do not fit
    but the weights can be served from a map of the packed-panel cache (`can_map`: a GGUF
    kept as stored), leaving the memory to the reserve (the KV cache)."""
    weights = estimate_weight_bytes(config, policy, parallel)
    parts = {f"weights as {policy.mode} in {str(policy.dtype).removeprefix('torch.')}": weights,
             "KV cache": reserve_bytes}
    advice = "choose a smaller model or --quantization, or lower --kv-cache-memory-bytes"
    if can_map:
        try:
            check_fits(weights + reserve_bytes, f"loading {source.name}", parts, advice)
        except InsufficientMemoryError:
            check_fits(reserve_bytes, f"loading {source.name} with its weights mapped",
                       {"KV cache": reserve_bytes}, "lower --kv-cache-memory-bytes")
            logger.warning(
                "%s: its weights (%.2f GiB) and KV cache (%.2f GiB) exceed the memory "
                "available (%.2f GiB): the weights are served from a map of the packed-panel "
                "cache (written run by run as they load where it is not there yet), so steps "
                "read whatever is not in the page cache from disk: expect decode steps many "
                "times slower than in memory where they route to experts not read recently",
                source.name, weights / 2**30, reserve_bytes / 2**30,
                (available_memory_bytes() or 0) / 2**30)
            return True
        return False
    check_fits(weights + reserve_bytes, f"loading {source.name}", parts, advice)
    return False


def _checkpoint_tensors(source: ModelSource, reader, config: ModelConfig,
                        parallel: ParallelContext | None):
    """HF-named tensors, lazily, one at a time: an HF directory's (lazy slices when several
    ranks each take theirs), or a GGUF's (`reader`, opened once per load) as the file stores
    them (block-quantized ones as `QuantizedRows`, which each layer keeps, or dequantizes if
    its method converts)."""
    if source.format == "hf" and config.source_weight_type == "fp8":
        return with_model_prefix(iter_fp8_checkpoint(safetensors_files(source.path),
                                                     config.weight_block_size))
    if source.format == "hf":
        return with_model_prefix(iter_safetensors(safetensors_files(source.path),
                                                  lazy=is_distributed(parallel)))
    return gguf_stored.iter_gguf_stored(reader, config)


def iter_hf_checkpoint(source: ModelSource, config: ModelConfig):
    """An HF directory's tensors by name, as the model's own load reads them (fp8 weights
    paired with their scales): for modules loaded beside the model (MTP's)."""
    return _checkpoint_tensors(source, None, config, None)


def _source_types(source: ModelSource, reader, config: ModelConfig) -> dict[str, str]:
    """A GGUF's tensor types by HF name, or a block-scaled fp8 checkpoint's dtypes (which of
    its projections are fp8); empty for another HF directory."""
    if reader is not None:
        return gguf_stored.tensor_types(reader, config)
    if config.source_weight_type == "fp8":
        return tensor_dtypes(safetensors_files(source.path))
    return {}


def _on_device(tensors: Iterable, device: str | torch.device) -> Iterator:
    if torch.device(device).type == "cpu":
        yield from tensors
        return
    for name, tensor in tensors:
        yield name, (tensor if isinstance(tensor, torch.Tensor) else tensor[:]).to(device)


def _has_fast_low_bit_kernels(device: str, use_cpu_kernels: bool) -> bool:
    """Our vectorised low-bit kernels are loaded (the scalar build's are slower than a float32
    GEMV, and the torch reference versions dequantize whole matrices per call)."""
    return device == "cpu" and get_ops(use_cpu_kernels).int4_linear_fast()


def random_model(config: ModelConfig, dtype: str | torch.dtype = "float32", seed: int = 0,
                 device: str = "cpu", attention_backend: str = "torch_ref",
                 use_cpu_kernels: bool = True, quantization: str = "none",
                 parallel: ParallelContext | None = None):
    """A model with small random weights (deterministic for a seed), for fast tests: a random
    checkpoint of the whole model (norms at one), loaded as a real one would be; with
    `parallel`, this rank's shard of exactly the model one rank gives for `config`."""
    model = build_model(config, resolve_dtype(dtype), device, attention_backend, use_cpu_kernels,
                        quantization, parallel)
    generator = torch.Generator().manual_seed(seed)
    shapes = _full_checkpoint_shapes(config, attention_backend)
    tensors = ((name, torch.ones(shape) if name.endswith("norm.weight")
                else torch.randn(shape, generator=generator) * 0.05)
               for name, shape in shapes.items())
    model.load_weights((name, tensor) for name, tensor in tensors if model.holds(name))
    return model


def _full_checkpoint_shapes(config: ModelConfig, attention_backend: str) -> dict:
    """The whole model's checkpoint (every stage's tensors, in order), from a one-rank build on
    the meta device: the same names and draws whatever the rank."""
    backend = get_attention_backend(attention_backend, False)
    with torch.device("meta"):
        whole = model_class_for(config.architecture)(config, backend, None,
                                                     QuantPolicy("none", torch.float32))
    return whole.checkpoint_shapes()
