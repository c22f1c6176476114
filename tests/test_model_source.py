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


def test_assembled_model_is_joined_once_into_the_cache(tmp_path, monkeypatch):
    """`gemma3-270m`-style short names: the part package's assemble() writes a temporary file,
    renamed into the cache directory when whole; later resolves read it without assembling."""
    from kvserve.model_source import ASSEMBLED_MODELS

    package = tmp_path / "packages" / "fake_model_parts"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "CALLS = []\n"
        "def assemble(path, overwrite=False):\n"
        "    CALLS.append(str(path))\n"
        "    open(path, 'wb').write(b'GGUF')\n"
        "    return path\n")
    monkeypatch.syspath_prepend(str(tmp_path / "packages"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(ASSEMBLED_MODELS, "fake-1m",
                        ("fake_model_parts", "fake.gguf", "fake-model-parts==1.0"))
    source = resolve_model("fake-1m")
    assert source.format == "gguf" and source.path == tmp_path / "cache" / "models" / "fake.gguf"
    assert resolve_model("Fake-1M").path == source.path
    import fake_model_parts

    assert len(fake_model_parts.CALLS) == 1 and fake_model_parts.CALLS[0].endswith(".partial")
    assert list(source.path.parent.iterdir()) == [source.path]


def test_assembled_model_names_its_missing_package(tmp_path, monkeypatch):
    from kvserve.model_source import ASSEMBLED_MODELS

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(ASSEMBLED_MODELS, "absent-1m",
                        ("no_such_model_parts", "absent.gguf", "absent-parts==1.0"))
    with pytest.raises(ModelNotFoundError, match="pip install absent-parts==1.0"):
        resolve_model("absent-1m")
