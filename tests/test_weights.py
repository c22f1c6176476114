"""GGUF and HF weight loading: config, name mapping, Q/K un-permutation, cache, typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.errors import (
    CorruptModelFileError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from kvserve.model_source import resolve_model
from kvserve.models import load_model, random_model
from kvserve.testing.tiny import tiny_config
from kvserve.weights import gguf_file, load_config
from tests.helpers import llama_cpp_permute, write_gguf

gguf = pytest.importorskip("gguf")


def _hf_tensors(config, seed=0) -> tuple[dict[str, np.ndarray], torch.nn.Module]:
    model = random_model(config, "float32", seed=seed)
    return {name: t.numpy() for name, t in model.hf_state_dict().items()}, model


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_real_gguf_config(smollm_source):
    config = load_config(smollm_source)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_gguf_round_trip_unpermutes_and_maps_names(tmp_path, isolated_cache, qtype):
    config = tiny_config(vocab_size=256, hidden_size=64)
    tensors, reference = _hf_tensors(config)
    path = tmp_path / "tiny.gguf"
    quant = getattr(gguf.GGMLQuantizationType, qtype) if qtype else None
    write_gguf(path, config, tensors, qtype=quant)
    loaded, loaded_config = load_model(resolve_model(path), "float32")
    assert loaded_config.num_hidden_layers == 2 and loaded_config.tie_word_embeddings
    tolerance = 0.0 if qtype is None else 0.01  # Q8_0 rounds to 1/127 of each block's max
    for name, param in reference.named_parameters():
        delta = (dict(loaded.named_parameters())[name] - param).abs().max().item()
        assert delta <= tolerance, name
    # nothing but the config and tokenizer go to the cache; a second load is identical
    assert not any(isolated_cache.rglob("*.safetensors"))
    again, _ = load_model(resolve_model(path), "float32")
    for (name, a), (_, b) in zip(loaded.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def _names_every_supported_architecture(error) -> None:
    from kvserve.models.families import BUILTIN_FAMILIES

    message = str(error.value)
    assert all(name in message for name in BUILTIN_FAMILIES), message


def test_unsupported_architecture(tmp_path, isolated_cache):
    """An architecture we do not implement fails at load, naming the ones we do."""
    config = tiny_config(vocab_size=256)
    tensors, _ = _hf_tensors(config)
    path = tmp_path / "falcon.gguf"
    write_gguf(path, config, tensors, arch="falcon")
    with pytest.raises(UnsupportedArchitectureError, match="'falcon' is not supported") as error:
        load_model(resolve_model(path))
    _names_every_supported_architecture(error)
    # the engine checks the architecture before it builds the tokenizer (this file has none)
    from kvserve import LLM

    with pytest.raises(UnsupportedArchitectureError, match="falcon"):
        LLM(model=str(path), engine_core="thread")


def test_unsupported_quantization(tmp_path, isolated_cache):
    config = tiny_config(vocab_size=256)
    tensors, _ = _hf_tensors(config)
    q8k = gguf.GGMLQuantizationType.Q8_K
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q8k]
    shape = tensors["model.layers.0.mlp.down_proj.weight"].shape  # [64, 128]
    raw = np.zeros((shape[0], shape[1] // block_elems * block_bytes), dtype=np.uint8)
    path = tmp_path / "q8k.gguf"
    write_gguf(path, config, tensors, raw_override={"blk.0.ffn_down.weight": (raw, q8k)})
    with pytest.raises(UnsupportedQuantizationError, match="Q8_K"):
        load_model(resolve_model(path))


def test_corrupt_gguf(tmp_path, isolated_cache, smollm_source):
    path = tmp_path / "broken.gguf"
    path.write_bytes(smollm_source.path.read_bytes()[:100_000])
    with pytest.raises(CorruptModelFileError, match="not a readable GGUF"):
        load_model(resolve_model(path))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(CorruptModelFileError):
        load_model(resolve_model(garbage))


def test_missing_file_is_a_clear_error(tmp_path):
    from kvserve.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope.gguf")


def test_hf_directory_missing_weights(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(CorruptModelFileError, match="safetensors"):
        load_model(resolve_model(tmp_path))


def test_hf_directory_unsupported_model_type(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(UnsupportedArchitectureError, match="mamba") as error:
        load_model(resolve_model(tmp_path))
    _names_every_supported_architecture(error)


def test_unpermute_invertsllama_cpp_permute():
    rows = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    assert np.array_equal(gguf_file.unpermute_rope_rows(llama_cpp_permute(rows, 3), 3), rows)


@pytest.mark.parametrize("rotary, head_dim", [(96, 128), (30, 44), (64, 64)])
def test_gguf_rope_dimension_count_is_the_rotary_dim(rotary, head_dim):
    """llama.cpp's rope.dimension_count as HF's partial_rotary_factor: HF's int(head_dim *
    factor) gives the count back, also where rotary / head_dim would truncate to one less."""
    factor = gguf_file._partial_rotary_factor(rotary, head_dim)
    assert tiny_config(head_dim=head_dim, partial_rotary_factor=factor).rotary_dim == rotary


def test_experts_in_a_family_without_them_are_refused_at_load():
    """A GGUF whose family kvserve runs dense but whose file has experts is refused by name,
    not loaded as a dense model that lacks its MLPs (a "llama" file with experts is Mixtral)."""
    meta = {"general.architecture": "gemma3", "gemma3.expert_count": 8}
    with pytest.raises(UnsupportedArchitectureError, match="mixture of 8 experts"):
        gguf_file.config_from_metadata(meta, set())


def _edited_copy(tiny_model_dir, tmp_path, edit):
    """The tiny HF directory with its safetensors edited by `edit(tensors)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "edited"
    shutil.copytree(tiny_model_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory


DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_tensor_that_disagrees_with_the_config_is_named(tiny_model_dir, tmp_path, lazy,
                                                          monkeypatch):
    """A shape the config does not give, or integers where a weight should be, fails at load
    naming the tensor (whole tensors, and the lazy slices tensor parallelism reads)."""
    import kvserve.models.loader as loader

    if lazy:
        monkeypatch.setattr(loader, "is_distributed", lambda parallel: True)
        monkeypatch.setattr(loader, "with_layer_partition", lambda parallel, *a: parallel)
    wrong_shape = _edited_copy(tiny_model_dir, tmp_path / "shape",
                               lambda t: t.__setitem__(DOWN, torch.zeros(64, 100)))
    with pytest.raises(CorruptModelFileError, match=rf"'{DOWN}' has shape \[64, 100\].*"
                                                    rf"\[64, 128\]"):
        load_model(resolve_model(wrong_shape))
    integers = _edited_copy(tiny_model_dir, tmp_path / "ints",
                            lambda t: t.__setitem__(DOWN, torch.zeros(64, 128,
                                                                      dtype=torch.int32)))
    with pytest.raises(CorruptModelFileError, match=rf"'{DOWN}' has type .*(int32|I32)"):
        load_model(resolve_model(integers))
    norm = "model.layers.0.input_layernorm.weight"  # a plain parameter: no silent broadcast
    broadcast = _edited_copy(tiny_model_dir, tmp_path / "norm",
                             lambda t: t.__setitem__(norm, torch.ones(1)))
    with pytest.raises(CorruptModelFileError, match=rf"'{norm}' has shape \[1\]"):
        load_model(resolve_model(broadcast))


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    import shutil

    directory = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(CorruptModelFileError, match="model.safetensors"):
        load_model(resolve_model(directory))


def test_a_model_that_cannot_fit_fails_naming_the_bytes(smollm_source, monkeypatch):
    """Weights plus the KV cache the engine will ask for, against the memory available (here
    set lower than SmolLM2's ~140 MB of stored weights): a typed error before anything is read,
    never an OOM kill half-way. The GGUF's blocks kept as stored can be served from a map of
    their packed copy (tests/test_pack_cache.py), but the KV cache must still fit."""
    from kvserve.errors import InsufficientMemoryError
    from kvserve.memory import AVAILABLE_ENV, CHECK_ENV

    monkeypatch.setenv(AVAILABLE_ENV, str(50 << 20))
    with pytest.raises(InsufficientMemoryError, match=r"needs about 0\.\d\d GiB \([\d,]+ bytes: "
                                                      r"weights as none in float32"):
        load_model(smollm_source, "float32")
    with pytest.raises(InsufficientMemoryError, match="with its weights mapped .*KV cache 0.06"):
        load_model(smollm_source, "bfloat16", quantization="gguf", reserve_bytes=60 << 20)
    monkeypatch.setenv(CHECK_ENV, "0")
    load_model(smollm_source, "bfloat16", quantization="gguf")


def test_a_cgroup_v1_memory_limit_counts_as_the_memory_available(tmp_path, monkeypatch):
    """Under cgroup v1 (this process's memory cgroup, named in /proc/self/cgroup) the memory
    available is at most the limit less the usage, plus the inactive file pages the kernel
    reclaims first; "no limit" (2^63 rounded down to a page) is no bound."""
    from kvserve import memory

    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/jobs/a\n0::/\n")
    group = tmp_path / "fs" / "memory" / "jobs" / "a"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    (group / "memory.usage_in_bytes").write_text(f"{2 << 30}\n")
    (group / "memory.stat").write_text(f"cache 100\ntotal_inactive_file {512 << 20}\n")
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP", tmp_path / "fs")
    monkeypatch.delenv(memory.AVAILABLE_ENV, raising=False)
    assert memory._cgroup_v1_remaining() == (1 << 30) + (512 << 20)
    assert memory.available_memory_bytes() <= (1 << 30) + (512 << 20)
    (group / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory._cgroup_v1_remaining() is None


def test_a_kv_cache_that_cannot_fit_fails_naming_the_bytes(tiny_model_dir, monkeypatch):
    from kvserve import LLM
    from kvserve.errors import InsufficientMemoryError
    from kvserve.memory import AVAILABLE_ENV

    monkeypatch.setenv(AVAILABLE_ENV, str(200 << 20))
    with pytest.raises(InsufficientMemoryError, match=r"the KV cache needs about 0\.31 GiB "
                                                      r"\([\d,]+ bytes: 40000 blocks of 8,192"):
        LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=40000, block_size=16,
            engine_core="thread")
