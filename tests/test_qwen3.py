"""Qwen3 (QK-norm: each query and key head RMS-normalised before RoPE; no QKV bias) on a tiny
random checkpoint made by HF transformers' own Qwen3 classes, against HF's forward pass: logits
within 1e-4 in float32 on every attention path, greedy tokens equal to HF's `generate` batched,
alone and chunked, and through the engine with chunked prefill and prefix hits."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model_source import resolve_model
from kvserve.models import load_model
from kvserve.models.paged_loop import PagedLoop
from tests.helpers import (
    assert_engine_chunked_and_cached_match,
    assert_greedy_batched_and_alone,
    assert_last_logits_match_hf,
    tiny_family_case,
)

transformers = pytest.importorskip("transformers")

VOCAB, NEW_TOKENS, MAX_LEN = 512, 16, 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, initializer_range=1.0, bos_token_id=1,
            eos_token_id=None, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer):
    """A 3-layer Qwen3 with random norm weights too (HF initialises them to ones, which would
    hide a QK-norm applied without its weight), its prompts and HF's logits and tokens."""
    return tiny_family_case("qwen3", transformers.Qwen3Config(**TINY),
                            tmp_path_factory.mktemp("qwen3"), tokenizer, (40, 7, 90), NEW_TOKENS)


def test_config_reads_qk_norm_and_windows():
    config = ModelConfig.from_hf_dict(transformers.Qwen3Config(**TINY).to_dict())
    assert config.architecture == "qwen3" and config.qk_norm and not config.attention_bias
    assert config.head_dim == 32  # Qwen3 sets it apart from hidden / heads
    windowed = transformers.Qwen3Config(**dict(TINY, num_hidden_layers=4),
                                        use_sliding_window=True, sliding_window=16,
                                        max_window_layers=2)
    assert ModelConfig.from_hf_dict(windowed.to_dict()).sliding_windows == (None, None, 16, 16)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()).qk_norm


@pytest.mark.parametrize("backend", ["torch_ref", "paged", "sdpa_batched"])
def test_logits_match_hf(qwen3, backend):
    model, config = load_model(resolve_model(qwen3["dir"]), "float32", attention_backend=backend)
    assert config.qk_norm
    assert_last_logits_match_hf(model, qwen3, MAX_LEN)


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_greedy_tokens_match_hf_batched_and_alone(qwen3, backend):
    model, _ = load_model(resolve_model(qwen3["dir"]), "float32", attention_backend=backend)
    assert_greedy_batched_and_alone(model, qwen3["prompts"], qwen3["tokens"], NEW_TOKENS,
                                    MAX_LEN)


def test_gguf_file_loads_as_the_hf_directory(qwen3, tmp_path, monkeypatch):
    """The same weights in a GGUF as llama.cpp names them (attn_q_norm / attn_k_norm, no Q/K
    row permutation for Qwen): the config and the logits are the HF directory's."""
    from safetensors.torch import load_file

    from tests.helpers import write_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    shape = ModelConfig.from_hf_dict(transformers.Qwen3Config(**TINY).to_dict())
    tensors = {name: tensor.numpy() for name, tensor in
               load_file(str(qwen3["dir"] / "model.safetensors")).items()}
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, shape, tensors, arch="qwen3",
               metadata=lambda writer: writer.add_key_length(shape.head_dim))
    model, config = load_model(resolve_model(path), "float32", attention_backend="paged")
    assert config.architecture == "qwen3" and config.qk_norm and config.head_dim == 32
    prompt = qwen3["prompts"][0]
    logits = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    torch.testing.assert_close(logits.float(), qwen3["logits"][0], atol=1e-4, rtol=1e-4)


def test_qk_norm_matters(qwen3):
    """The parity above means something: without QK-norm the logits move far off HF's."""
    model, _ = load_model(resolve_model(qwen3["dir"]), "float32", attention_backend="torch_ref")
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    prompt = qwen3["prompts"][0]
    logits = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    assert (logits - qwen3["logits"][0]).abs().max() > 0.1


@pytest.mark.slow
def test_engine_chunked_prefill_and_prefix_hits_match_hf(qwen3):
    """Through the engine (fused path, compiled kernels where the machine has them): prompts
    chunked by a 32-token budget, then again from the prefix cache, give HF's tokens."""
    assert_engine_chunked_and_cached_match(qwen3["dir"], qwen3["prompts"], qwen3["tokens"],
                                           NEW_TOKENS)
