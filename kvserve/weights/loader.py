"""Format-independent entry points: a ModelSource -> ModelConfig and HF-named tensors.

GGUF metadata is parsed once and cached as JSON (see cache.py); GGUF tensors are dequantized to
float32 exactly, with a progress bar. Each phase's time is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from tqdm import tqdm

from kvserve.config import ModelConfig
from kvserve.model_source import ModelSource
from kvserve.weights import cache, gguf_file, hf_dir

logger = logging.getLogger(__name__)


def load_config(source: ModelSource, use_cache: bool = True) -> ModelConfig:
    if source.format == "hf":
        return hf_dir.load_hf_config(source.path)

    def parse() -> dict:
        return dataclasses.asdict(gguf_file.load_gguf_config(source.path))

    return ModelConfig(**cache.cached_json(source.path, "config.json", parse, use_cache))


def load_hf_named_tensors(source: ModelSource, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All of the checkpoint's tensors under HF names (float32 for GGUF: exact dequantization)."""
    start = time.perf_counter()
    if source.format == "hf":
        tensors = dict(hf_dir.iter_hf_tensors(source.path))
        logger.info("read %d tensors from %s in %.2fs", len(tensors), source.path,
                    time.perf_counter() - start)
        return tensors
    reader = gguf_file.open_gguf(source.path)
    tensors = {}
    items = gguf_file.iter_gguf_tensors(reader, config)
    progress = tqdm(items, total=len(reader.tensors), desc="Dequantizing GGUF", unit="tensor",
                    leave=False, disable=None)
    for name, array in progress:
        # F32 tensors come straight from the read-only memory map; torch wants writable memory
        tensors[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
    logger.info("dequantized %d GGUF tensors from %s in %.2fs", len(tensors), source.path.name,
                time.perf_counter() - start)
    return tensors
