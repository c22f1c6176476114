"""Model resolution: short names, .gguf paths, HF directories, and clear errors otherwise."""

from __future__ import annotations

import pytest

from kvserve.errors import ModelNotFoundError
from kvserve.model_source import resolve_model


def test_default_is_bundled_smollm():
    source = resolve_model(None)
    assert source.format == "gguf"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("SmolLM2-135M-Instruct").path == source.path


def test_gguf_path_and_directory_with_one_gguf(smollm_source, tmp_path):
    assert resolve_model(str(smollm_source.path)).path == smollm_source.path
    (tmp_path / "model.gguf").symlink_to(smollm_source.path)
    assert resolve_model(tmp_path).format == "gguf"


def test_unknown_name_lists_what_was_tried():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("meta-llama/Llama-3-8B")
    message = str(info.value)
    assert "bundled short name" in message
    assert "does not exist" in message
    assert "never downloads" in message


def test_directory_without_model_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)


def test_non_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(path)
