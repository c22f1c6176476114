"""Format-independent entry point: a ModelSource -> ModelConfig (GGUF metadata parsed once and
cached as JSON, see cache.py). The tensors are read where they are loaded (models/loader.py:
safetensors lazily, a GGUF as it stores them, weights/gguf_stored.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from kvserve.config import ModelConfig
from kvserve.model_source import ModelSource
from kvserve.weights import cache, gguf_file, hf_dir


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
