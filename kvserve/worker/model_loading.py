"""Loading a worker's model as the engine options ask (dtype, backend, kernels, quantization,
KV dtype), whole or as one rank's shard."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.engine_config import EngineConfig
from kvserve.kernels.reference import is_row_quantized
from kvserve.model_source import resolve_model
from kvserve.models import load_model, resolve_dtype
from kvserve.platform import default_dtype, kv_cache_dtype

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig  # the rank's (its heads) when sharded
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str


def kv_page_bytes(model, kv_dtype: torch.dtype) -> int:
    """One token's bytes in one layer's KV page, the largest of the model's (this stage's)
    layers, as they declare their layouts."""
    return max(layout.bytes_per_token for layout in model.kv_page_layouts(kv_dtype))


def load_engine_model(config: EngineConfig, parallel=None) -> LoadedModel:
    """The model as the engine options ask for it (dtype, backend, kernels, quantization, KV
    dtype); with a tensor-parallel `parallel` context, this rank's shard."""
    start = time.perf_counter()
    source = resolve_model(config.model)
    dtype = default_dtype(config.device) if config.dtype == "auto" else resolve_dtype(
        config.dtype)
    extra = {"parallel": parallel} if parallel is not None else {}
    # this rank's share of the KV cache budget (an exact block count is checked when the
    # engine core sizes the pool)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    kv_share = 0 if config.num_kv_blocks is not None else config.kv_cache_bytes() // world
    model, model_config = load_model(
        source, dtype, config.device, config.attention_backend,
        use_cpu_kernels=config.cpu_kernels, quantization=config.quantization,
        dtype_is_default=config.dtype == "auto", max_model_len=config.max_model_len,
        reserve_bytes=kv_share, **extra)
    if hasattr(model, "model") and hasattr(model.model, "enforce_eager"):
        model.model.enforce_eager = config.enforce_eager
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, config.dtype == "auto",
                              config.device)
    if kv_dtype not in (dtype, torch.bfloat16) and not is_row_quantized(kv_dtype):
        raise ValueError(f"a {kv_dtype} KV cache needs {kv_dtype} activations (they are "
                         f"{dtype})")
    logger.info("model loaded in %.2fs", time.perf_counter() - start)
    return LoadedModel(model, getattr(model, "config", model_config), dtype, kv_dtype,
                       getattr(model, "quantization", "none"))
