"""Read HF model directories: config.json and *.safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator


from kvserve.config import ModelConfig
from kvserve.errors import CorruptModelFileError


def load_hf_config(directory: Path, check_architecture=None) -> ModelConfig:
    """config.json as our ModelConfig; `check_architecture(model_type, where)` first (see
    weights.loader.load_config; it maps the HF model_type once every family is registered)."""
    config_path = directory / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorruptModelFileError(f"Cannot read {config_path}: {exc}") from exc
    if check_architecture is not None:
        check_architecture(raw.get("model_type"), f"{config_path}'s model_type")
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise CorruptModelFileError(f"{config_path} lacks required field {exc}") from exc


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CorruptModelFileError(
            f"{directory} has no *.safetensors files (PyTorch .bin checkpoints are not read: "
            "convert them with save_pretrained(safe_serialization=True))."
        )
    return files


# a base model's tensor names (saved from Qwen3Model, LlamaModel, ...: embedding checkpoints)
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def with_model_prefix(tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """A base model's checkpoint names its tensors without the `model.` a causal LM's carry
    (and has no LM head): they get it, so one loader takes both."""
    for name, tensor in tensors:
        yield (f"model.{name}" if name.startswith(_BASE_MODEL_PREFIXES) else name), tensor
