"""Sliding windows: per-layer windows read as HF transformers reads them (HF configs, GGUF
metadata), and a backend that cannot apply them refused at load."""

from __future__ import annotations

import json

import pytest

from kvserve.attention import backends
from kvserve.config import ModelConfig
from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError
from kvserve.model_source import resolve_model
from kvserve.models import load_model, random_model
from kvserve.testing.tiny import tiny_config, write_tiny_model_dir
from kvserve.weights.gguf_file import config_from_metadata

transformers = pytest.importorskip("transformers")


# ---- configs: which layers get a window, as HF transformers decides


def _hf_windows(hf_config) -> tuple:
    """HF's own per-layer answer (transformers 5.x): Mistral windows every layer; Qwen2 the
    layers its `layer_types` mark sliding."""
    layers = hf_config.num_hidden_layers
    if hf_config.model_type == "mistral":
        return (hf_config.sliding_window,) * layers if hf_config.sliding_window else ()
    windows = tuple(hf_config.sliding_window if kind == "sliding_attention" else None
                    for kind in hf_config.layer_types)
    return windows if any(windows) else ()


@pytest.mark.parametrize("hf_config", [
    transformers.MistralConfig(num_hidden_layers=3, sliding_window=64),
    transformers.MistralConfig(num_hidden_layers=3, sliding_window=None),
    transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                             max_window_layers=1),
    transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=False, sliding_window=32,
                             max_window_layers=1),
    transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                             layer_types=["sliding_attention", "full_attention"] * 2),
], ids=["mistral", "mistral-full", "qwen2-upper", "qwen2-off", "qwen2-layer-types"])
def test_hf_config_windows_match_transformers(hf_config):
    raw = hf_config.to_dict()
    config = ModelConfig.from_hf_dict(raw)
    assert config.sliding_windows == _hf_windows(hf_config)
    # a config.json saved before `layer_types` existed: Qwen2 derives it from max_window_layers
    raw.pop("layer_types", None)
    if "max_window_layers" in raw and hf_config.max_window_layers == 1:
        assert ModelConfig.from_hf_dict(raw).sliding_windows == _hf_windows(hf_config)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_hf_config_defaults_and_families():
    base = tiny_config().to_hf_dict()
    # MistralConfig's default window when config.json has no key; null: full attention
    mistral = dict(base, model_type="mistral", num_hidden_layers=2)
    assert ModelConfig.from_hf_dict(mistral).sliding_windows == (4096, 4096)
    assert ModelConfig.from_hf_dict(dict(mistral, sliding_window=None)).sliding_windows == ()
    # HF's Llama has no windows whatever its config says
    assert ModelConfig.from_hf_dict(dict(base, sliding_window=8)).sliding_windows == ()
    # other families (Gemma 3 later) follow layer_types; a config per layer of its own kind
    gemma_like = dict(base, model_type="gemma3_text", sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
    assert ModelConfig.from_hf_dict(gemma_like).sliding_windows == (8, None)
    assert ModelConfig.from_hf_dict(gemma_like).sliding_window(1) is None
    with pytest.raises(CorruptModelFileError, match="sliding_window"):
        ModelConfig.from_hf_dict(dict(gemma_like, sliding_window=None))
    with pytest.raises(UnsupportedArchitectureError, match="chunked_attention"):
        ModelConfig.from_hf_dict(dict(gemma_like, layer_types=["chunked_attention"] * 2))
    with pytest.raises(ValueError, match="positive"):
        tiny_config(sliding_windows=(0, None))
    # the JSON cache of GGUF configs hands back lists
    assert tiny_config(sliding_windows=[8, None]).sliding_windows == (8, None)


def _gguf_meta(**extra):
    meta = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.vocab_size": 512,
            "llama.feed_forward_length": 128, "llama.block_count": 6,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 1024}
    meta.update({f"llama.attention.{key}": value for key, value in extra.items()})
    return config_from_metadata(meta, {"output.weight"}).sliding_windows


def test_gguf_sliding_window_metadata():
    assert _gguf_meta() == ()
    assert _gguf_meta(sliding_window=0) == ()
    assert _gguf_meta(sliding_window=512) == (512,) * 6
    # llama.cpp's pattern: an integer n windows every layer but each n-th (0: all)
    assert _gguf_meta(sliding_window=512, sliding_window_pattern=3) == (512, 512, None) * 2
    assert _gguf_meta(sliding_window=512, sliding_window_pattern=0) == (512,) * 6
    pattern = [True, False, True, True, False, False]
    assert _gguf_meta(sliding_window=8, sliding_window_pattern=pattern) == (
        8, None, 8, 8, None, None)
    with pytest.raises(CorruptModelFileError, match="entries"):
        _gguf_meta(sliding_window=8, sliding_window_pattern=[True])


# ---- a backend that cannot apply windows: refused at load, never wrong tokens


class _FullAttentionOnly:
    name = "full_only"

    def forward(self, query, key, value, kv_cache, metadata, scale, sliding_window=0):
        return backends.TorchReferenceBackend().forward(query, key, value, kv_cache, metadata,
                                                        scale)


def test_backend_without_windows_is_refused_at_load(monkeypatch, tmp_path, tokenizer):
    monkeypatch.setitem(backends._BACKENDS, "full_only",
                        lambda use_cpu_kernels: _FullAttentionOnly())
    assert random_model(tiny_config(), attention_backend="full_only") is not None
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window.*'full_only'"):
        random_model(tiny_config(sliding_windows=(None, 8)), attention_backend="full_only")
    directory = write_tiny_model_dir(tmp_path / "mistral", tokenizer, architecture="mistral",
                                     sliding_windows=(8, 8))
    assert json.loads((directory / "config.json").read_text())["sliding_window"] == 8
    with pytest.raises(UnsupportedArchitectureError, match="2 of its 2 layers"):
        load_model(resolve_model(directory), "float32", attention_backend="full_only")
    model, config = load_model(resolve_model(directory), "float32", attention_backend="paged")
    assert config.sliding_windows == (8, 8)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, 8]
