"""The families that run on the shared layers as config options (Gemma 3, Gemma 2, SmolLM3,
Phi-3 / Phi-4-mini), each on a tiny random checkpoint made by HF transformers' own config and
model classes, against HF's forward pass in float32: logits within 1e-4 on every attention path,
greedy tokens equal to HF's `generate` batched and alone, the same weights from a GGUF as
llama.cpp names and stores them, and through the engine with chunked prefill and prefix hits.

Every norm weight is drawn at random (HF initialises Gemma's to zero and Llama's to one, which
would hide a norm applied without its weight, or with the wrong offset), windows are short so
the prompts cross them, and Gemma 3's query scale differs from head_dim's. RoPE scalings
(LongRoPE, Llama 3, YaRN) are tests/test_families_rope.py's."""

from __future__ import annotations

import dataclasses

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
    convert_hf_to_gguf,
    edited_checkpoint,
    TINY_FAMILY_SHAPE,
    tiny_family_case,
)

transformers = pytest.importorskip("transformers")

NEW_TOKENS, MAX_LEN, WINDOW = 12, 256, 24
SHAPE = dict(TINY_FAMILY_SHAPE, head_dim=32, max_position_embeddings=1024)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
FAMILIES = {
    # local and global layers (every 6th global, as llama.cpp assumes) with their own RoPE
    # bases, QK-norm
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32,
        rope_parameters=GEMMA3_ROPE),
    # a query scale of 1/sqrt(24), not head_dim's (HF directories only: GGUF files have none)
    "gemma3-scaled": lambda: transformers.Gemma3TextConfig(
        **SHAPE, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"], rope_parameters=GEMMA3_ROPE),
    # attention and final logits soft-capped (small caps, so they bind on random weights),
    # windows on alternate layers
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=32,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # RoPE skipped on every fourth layer
    "smollm3": lambda: transformers.SmolLM3Config(**SHAPE, num_hidden_layers=4,
                                                  tie_word_embeddings=False),
    # Phi-4-mini's partial rotary (24 of 32 dims), Phi-3's fused checkpoint projections and its
    # window on every layer (head_dim is hidden / heads: Phi-3 and llama.cpp know no other);
    # LongRoPE is tests/test_families_rope.py's
    "phi3": lambda: transformers.Phi3Config(
        **dict(SHAPE, num_attention_heads=2, num_key_value_heads=1), num_hidden_layers=3,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.75}),
}
CONVERTIBLE = ("gemma2", "gemma3", "smollm3", "phi3")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    """One family's tiny checkpoint (saved by HF), its prompts (two longer than the window) and
    HF's last-position logits and greedy tokens for each."""
    # llama.cpp's Gemma 2 and Phi-3 converters read only SentencePiece
    return tiny_family_case(request.param, FAMILIES[request.param](),
                            tmp_path_factory.mktemp(request.param), tokenizer, (40, 7, 90),
                            NEW_TOKENS, sentencepiece=request.param in ("gemma2", "phi3"))


def test_gemma3_config_options():
    config = ModelConfig.from_hf_dict(FAMILIES["gemma3-scaled"]().to_dict())
    assert config.architecture == "gemma3" and config.qk_norm and config.sandwich_norms
    assert config.norm_weight_offset == 1.0 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.embedding_multiplier == pytest.approx(8.0) and config.tie_word_embeddings
    assert ModelConfig.from_hf_dict(FAMILIES["gemma3"]().to_dict()).sliding_windows == (
        (WINDOW,) * 5 + (None,))
    assert config.scale == pytest.approx(24**-0.5)
    assert config.sliding_windows == (WINDOW, WINDOW, None, WINDOW)
    assert [config.layer_rope(i) for i in range(4)] == ["local", "local", "global", "local"]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert again == config


def test_soft_caps_matter(family):
    """Gemma 2's parity means something: without its caps the logits move far off HF's."""
    if family["name"] != "gemma2":
        pytest.skip("no soft-capping")
    model, config = load_model(resolve_model(family["dir"]), "float32",
                               attention_backend="torch_ref")
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)
    for layer in model.model.layers:
        layer.self_attn.softcap = 0.0
    prompt = family["prompts"][0]
    logits = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    assert (logits - family["logits"][0]).abs().max() > 0.1


def test_phi3_config_options():
    config = ModelConfig.from_hf_dict(FAMILIES["phi3"]().to_dict())
    assert config.architecture == "phi3" and not config.tie_word_embeddings
    assert (config.head_dim, config.rotary_dim, config.partial_rotary_factor) == (32, 24, 0.75)
    assert config.sliding_windows == (WINDOW,) * 3 and config.rope_scaling is None
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_phi3_checkpoint_loads_fused_projections_as_they_are(family):
    """Phi-3 stores qkv_proj and gate_up_proj fused, in our parameters' order: they load whole
    (HF's rows, but for partial rotary each Q/K head's dims in our order) and export back
    equal."""
    if family["name"] != "phi3":
        pytest.skip("Phi-3 only")
    from safetensors.torch import load_file

    model, config = load_model(resolve_model(family["dir"]), "float32")
    checkpoint = load_file(str(family["dir"] / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in checkpoint
    ours = dict(model.named_parameters())
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    assert torch.equal(ours[gate_up], checkpoint[gate_up])
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    value_rows = slice(config.q_size + config.kv_size, None)
    assert torch.equal(ours[qkv][value_rows], checkpoint[qkv][value_rows])
    assert not torch.equal(ours[qkv], checkpoint[qkv])  # Q/K heads reordered
    exported = model.hf_state_dict()
    assert exported.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor), name


def test_partial_rotary_matters(family, tmp_path):
    """Phi-3's parity means something: rotating whole heads moves the logits far off HF's."""
    if family["name"] != "phi3":
        pytest.skip("Phi-3 only")
    whole = edited_checkpoint(family["dir"], tmp_path / "whole",
                              lambda c: c["rope_parameters"].update(partial_rotary_factor=1.0))
    model, config = load_model(resolve_model(whole), "float32", attention_backend="torch_ref")
    assert config.rotary_dim == config.head_dim
    prompt = family["prompts"][0]
    logits = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    assert (logits - family["logits"][0]).abs().max() > 0.1


def test_smollm3_config_skips_rope_on_every_fourth_layer():
    config = ModelConfig.from_hf_dict(FAMILIES["smollm3"]().to_dict())
    assert [config.layer_rope(i) for i in range(4)] == ["global"] * 3 + ["none"]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("backend", ["torch_ref", "paged", "sdpa_batched"])
def test_logits_match_hf(family, backend):
    model, _ = load_model(resolve_model(family["dir"]), "float32", attention_backend=backend)
    assert_last_logits_match_hf(model, family, MAX_LEN)


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_greedy_tokens_match_hf_batched_and_alone(family, backend):
    model, _ = load_model(resolve_model(family["dir"]), "float32", attention_backend=backend)
    assert_greedy_batched_and_alone(model, family["prompts"], family["tokens"], NEW_TOKENS,
                                    MAX_LEN)


@pytest.mark.slow
def test_converted_gguf_loads_as_the_hf_directory(family, tmp_path, monkeypatch):
    """The checkpoint through llama.cpp's own convert_hf_to_gguf.py (Gemma's norms stored as
    1 + w, SmolLM3's Q/K rows permuted, windows and RoPE bases as llama.cpp's metadata): the
    same config and HF's logits."""
    if family["name"] not in CONVERTIBLE:
        pytest.skip("llama.cpp's GGUF metadata cannot say this config")
    path = convert_hf_to_gguf(family["dir"], tmp_path / f"{family['name']}.gguf")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model, config = load_model(resolve_model(path), "float32", attention_backend="paged")
    from_hf = ModelConfig.from_hf_dict(family["hf_config"].to_dict())
    # float32 in GGUF; the file's tokenizer names an EOS; GGUF's scale is head_dim's, explicit
    assert config.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)
    assert config.scale == pytest.approx(from_hf.scale)
    assert dataclasses.replace(config, rms_norm_eps=from_hf.rms_norm_eps, eos_token_id=None,
                               attention_scale=from_hf.attention_scale) == from_hf
    assert_last_logits_match_hf(model, family, MAX_LEN)


@pytest.mark.slow
def test_engine_chunked_prefill_and_prefix_hits_match_hf(family):
    assert_engine_chunked_and_cached_match(family["dir"], family["prompts"], family["tokens"],
                                           NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "hybrid-off"])
def test_gemmas_run_the_hybrid_kv_layout(family, hybrid):
    """Through the engine, the windowed and full layers in KV cache groups of one size (one
    KV tensor per index within a group, shared), prompts chunked, then again from the prefix
    cache: HF's tokens. With --disable-hybrid-kv-cache-manager, one full group (every layer
    keeps all its KV, the kernels mask the windows): the same tokens."""
    from kvserve import LLM, SamplingParams

    if not family["name"].startswith("gemma"):
        pytest.skip("no windows")
    llm = LLM(model=str(family["dir"]), dtype="float32", block_size=8, num_kv_blocks=256,
              max_num_batched_tokens=32, enable_prefix_caching=True, engine_core="thread",
              disable_hybrid_kv_cache_manager=not hybrid)
    core = llm.llm_engine.engine_core
    groups = core.kv_manager.groups
    windowed = [g for g in groups if getattr(g.spec, "sliding_window", None)]
    if hybrid:
        assert len(groups) > 1 and windowed
        assert len(core.runner.kv_caches) == len(groups[0].layers)
    else:
        assert len(groups) == 1 and not windowed
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt} for prompt in family["prompts"]]
    for _ in range(2):
        results = llm.generate(requests, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in results] == family["tokens"]
    assert core.kv_manager.stats.hits > 0
