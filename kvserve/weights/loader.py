"""Format-independent entry points: a ModelSource -> ModelConfig and HF-named tensors.

GGUF metadata is parsed once and cached as JSON (see cache.py); GGUF tensors are dequantized to
float32 exactly, with a progress bar. Each phase's time is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from kvserve.config import ModelConfig
from kvserve.model_source import ModelSource
from kvserve.weights import cache, gguf_file, hf_dir

logger = logging.getLogger(__name__)


def load_config(source: ModelSource, use_cache: bool = True,
                check_architecture: Callable[[str, str], None] | None = None) -> ModelConfig:
    """The source's ModelConfig. `check_architecture(name, where)` runs on the architecture
    the file names before anything else is parsed (the model registry's check: an
    unsupported family fails there, not on a key its config lacks)."""
    check = check_architecture or (lambda name, where: None)
    if source.format == "hf":
        return hf_dir.load_hf_config(source.path, check)

    def parse() -> dict:
        return dataclasses.asdict(gguf_file.load_gguf_config(source.path, check))

    config = ModelConfig(**cache.cached_json(source.path, "config.json", parse, use_cache))
    check(config.architecture, str(source.path))
    return config


def load_hf_named_tensors(source: ModelSource, config: ModelConfig,
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under HF names, one at a time (float32 for GGUF: exact
    dequantization, one tensor in memory at a time)."""
    if source.format == "hf":
        yield from hf_dir.iter_hf_tensors(source.path)
        return
    start = time.perf_counter()
    reader = gguf_file.open_gguf(source.path)
    items = gguf_file.iter_gguf_tensors(reader, config)
    progress = tqdm(items, total=len(reader.tensors), desc="Dequantizing GGUF", unit="tensor",
                    leave=False, disable=None)
    count = 0
    for name, array in progress:
        # F32 tensors come straight from the read-only memory map; torch wants writable memory
        yield name, torch.from_numpy(array if array.flags.writeable else array.copy())
        count += 1
    logger.info("dequantized %d GGUF tensors from %s in %.2fs", count, source.path.name,
                time.perf_counter() - start)
