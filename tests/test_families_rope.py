"""RoPE scalings against HF transformers' own models: Phi-3 / Phi-4-mini's LongRoPE (with partial
rotary), Llama 3.x's `llama3` and Qwen2.5's YaRN, each on a tiny random checkpoint whose
pretraining context (original_max_position_embeddings) is 32 positions, so prompts of up to 100
tokens run far beyond it: float32 logits within 1e-4 of HF's on every attention path, greedy
tokens equal to HF's batched and alone, the same from a GGUF written by llama.cpp's own
converter, and logits far off HF's whenever a part of the scaling is turned off.

LongRoPE picks its factor set once per model from the engine's max_model_len (vLLM's and
llama.cpp's rule, `longrope_uses_long_factors`); HF picks per sequence length. Both agree on
sequences on the same side of the pretraining context as max_model_len, which is what is
compared: long prompts with the model's whole context, short ones with max_model_len 32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model_source import resolve_model
from kvserve.models import load_model
from kvserve.models.layers import RotaryEmbedding, apply_rotary, rotary_head_order
from kvserve.models.paged_loop import PagedLoop
from tests.helpers import (
    assert_engine_chunked_and_cached_match,
    assert_greedy_batched_and_alone,
    convert_hf_to_gguf,
    edited_checkpoint,
    hf_reference,
    TINY_FAMILY_SHAPE,
    tiny_family_case,
)

transformers = pytest.importorskip("transformers")

NEW_TOKENS, MAX_LEN, ORIGINAL = 12, 256, 32
SHAPE = dict(TINY_FAMILY_SHAPE, num_hidden_layers=2, max_position_embeddings=256)
VOCAB = SHAPE["vocab_size"]
LONG_PROMPTS, SHORT_PROMPT = (40, 100, 70), 12  # 12 + NEW_TOKENS stays within ORIGINAL
# head_dim 16, 12 of them rotated (Phi-4-mini's 0.75): 6 factors a set, far apart
SHORT_FACTORS = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG_FACTORS = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]
FAMILIES = {
    # context 256 over 32: HF's attention factor sqrt(1 + ln 8 / ln 32); a window on every layer
    "phi3-longrope": lambda: transformers.Phi3Config(
        **SHAPE, original_max_position_embeddings=ORIGINAL, sliding_window=48,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.75, "short_factor": SHORT_FACTORS,
                         "long_factor": LONG_FACTORS}),
    "llama3": lambda: transformers.LlamaConfig(
        **SHAPE, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": ORIGINAL}),
    # attention factor 0.1 ln 8 + 1, from the factor
    "qwen2-yarn": lambda: transformers.Qwen2Config(
        **SHAPE, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                         "original_max_position_embeddings": ORIGINAL}),
}


def _rope(config: dict) -> dict:
    return config["rope_parameters"]


# each family's parts, and a config.json edit that turns the part off (partial rotary:
# tests/test_families.py's test_partial_rotary_matters)
SWITCHES = {
    "phi3-longrope": {
        "scaling": lambda c: _rope(c).update(rope_type="default"),
        "attention factor": lambda c: _rope(c).update(attention_factor=1.0),
        "long factors": lambda c: _rope(c).update(long_factor=SHORT_FACTORS),
    },
    "llama3": {"scaling": lambda c: _rope(c).update(rope_type="default")},
    "qwen2-yarn": {
        "scaling": lambda c: _rope(c).update(rope_type="default"),
        "attention factor": lambda c: _rope(c).update(attention_factor=1.0),
    },
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    """One family's tiny checkpoint (saved by HF), prompts longer than its pretraining context,
    and HF's last-position logits and greedy tokens for each."""
    # llama.cpp's Phi-3 converter reads only SentencePiece; its Qwen2 one prefers it (and does
    # not recognise the SmolLM2 pre-tokenizer as transformers 5 loads it for a Qwen2 model)
    return tiny_family_case(request.param, FAMILIES[request.param](),
                            tmp_path_factory.mktemp(request.param), tokenizer, LONG_PROMPTS,
                            NEW_TOKENS,
                            sentencepiece=request.param in ("phi3-longrope", "qwen2-yarn"))


def _last_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    loop = PagedLoop(model, len(prompts), MAX_LEN)
    return loop.step(prompts, [len(p) for p in prompts], list(range(len(prompts))))


def _assert_match(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours.float(), theirs, atol=1e-4, rtol=1e-4)


def test_configs_read_the_scaling():
    phi3 = ModelConfig.from_hf_dict(FAMILIES["phi3-longrope"]().to_dict())
    assert (phi3.architecture, phi3.head_dim, phi3.rotary_dim) == ("phi3", 16, 12)
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert phi3.rope_scaling["long_factor"] == LONG_FACTORS
    assert phi3.sliding_windows == (48, 48)
    yarn = ModelConfig.from_hf_dict(FAMILIES["qwen2-yarn"]().to_dict())
    assert (yarn.rope_scaling["rope_type"], yarn.rope_scaling["factor"]) == ("yarn", 8.0)
    for name, make in FAMILIES.items():
        config = ModelConfig.from_hf_dict(make().to_dict())
        again = ModelConfig.from_hf_dict(config.to_hf_dict())
        assert again == config and again.rope_scaling == config.rope_scaling, name


def test_phi3_hub_config_fields():
    """Phi-3-mini-128k's and Phi-4-mini's config.json as published (transformers 4 names): the
    old "su" type, original_max_position_embeddings and partial_rotary_factor at top level."""
    hub = {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24,
           "num_key_value_heads": 8, "intermediate_size": 8192, "num_hidden_layers": 32,
           "vocab_size": 200064, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
           "rope_theta": 10000.0, "sliding_window": 262144,
           "rope_scaling": {"type": "su", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}}
    config = ModelConfig.from_hf_dict(hub)
    assert (config.head_dim, config.rotary_dim) == (128, 96)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.sliding_windows == (262144,) * 32
    del hub["original_max_position_embeddings"]  # Phi3Config's default, as in HF
    assert ModelConfig.from_hf_dict(hub).rope_scaling["original_max_position_embeddings"] == 4096


def test_partial_rotary_is_full_width_rotate_half_on_reordered_heads():
    """`rotary_head_order`'s claim, to the bit: HF's own Phi-3 rotary embedding and
    apply_rotary_pos_emb (rotate-half within the first rotary_dim dims, the rest passed
    through; LongRoPE's long factors and attention factor) on heads in HF's order, then
    reordered, equal our full-width rotation of the reordered heads with our table."""
    from transformers.models.phi3 import modeling_phi3

    hf_config = FAMILIES["phi3-longrope"]()
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    order = rotary_head_order(config)
    assert sorted(order.tolist()) == list(range(config.head_dim))
    heads = torch.randn(1, 4, 200, config.head_dim)  # HF's [batch, heads, tokens, head_dim]
    positions = torch.arange(200)
    hf_cos, hf_sin = modeling_phi3.Phi3RotaryEmbedding(hf_config)(heads, positions[None])
    assert hf_cos.shape[-1] == config.rotary_dim
    expected, _ = modeling_phi3.apply_rotary_pos_emb(heads, heads, hf_cos, hf_sin)
    ours_in = heads[0].transpose(0, 1)[..., order]  # our [tokens, heads, head_dim], reordered
    ours, _ = apply_rotary(ours_in, ours_in, RotaryEmbedding(config)(positions, torch.float32))
    assert torch.equal(ours, expected[0].transpose(0, 1)[..., order])


@pytest.mark.parametrize("backend", ["torch_ref", "paged", "sdpa_batched"])
def test_logits_match_hf_beyond_the_original_context(family, backend):
    model, _ = load_model(resolve_model(family["dir"]), "float32", attention_backend=backend)
    _assert_match(_last_logits(model, family["prompts"]), family["logits"])


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_greedy_tokens_match_hf_batched_and_alone(family, backend):
    model, _ = load_model(resolve_model(family["dir"]), "float32", attention_backend=backend)
    assert_greedy_batched_and_alone(model, family["prompts"], family["tokens"], NEW_TOKENS,
                                    MAX_LEN)


@pytest.mark.parametrize("switch", ["scaling", "attention factor", "long factors"])
def test_each_part_of_the_scaling_matters(family, switch, tmp_path):
    """The parity above means something: with any part of the scaling off, the logits of the
    longest prompt move far off HF's."""
    edit = SWITCHES[family["name"]].get(switch)
    if edit is None:
        pytest.skip(f"{family['name']} has no {switch}")
    edited = edited_checkpoint(family["dir"], tmp_path / "edited", edit)
    model, _ = load_model(resolve_model(edited), "float32", attention_backend="paged")
    longest = max(range(len(family["prompts"])), key=lambda i: len(family["prompts"][i]))
    logits = _last_logits(model, [family["prompts"][longest]])[0]
    assert (logits - family["logits"][longest]).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_longrope_short_factors_within_the_original_context(family, backend):
    """max_model_len within the pretraining context: the short factors, as HF uses for a
    sequence that stays within it (logits and greedy tokens); the long factors, which a longer
    max_model_len fixes for every sequence, give other logits there (HF's per-length switch is
    not followed, by design)."""
    if family["name"] != "phi3-longrope":
        pytest.skip("LongRoPE only")
    prompt = torch.randint(3, VOCAB, (SHORT_PROMPT,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    (expected_logits,), (expected_tokens,) = hf_reference(family["hf_model"], [prompt],
                                                          NEW_TOKENS)
    source = resolve_model(family["dir"])
    model, config = load_model(source, "float32", attention_backend=backend,
                               max_model_len=ORIGINAL)
    assert config.max_model_len == ORIGINAL
    _assert_match(_last_logits(model, [prompt]), [expected_logits])
    assert PagedLoop(model, 1, MAX_LEN).greedy([prompt], NEW_TOKENS) == [expected_tokens]
    long_model, _ = load_model(source, "float32", attention_backend=backend)
    assert (_last_logits(long_model, [prompt])[0] - expected_logits).abs().max() > 0.1


@pytest.mark.slow
def test_engine_max_model_len_picks_the_short_factors(family):
    """`LLM(max_model_len=...)` reaches the model (worker/model_loading.py): within the
    pretraining context the engine's greedy tokens are HF's."""
    if family["name"] != "phi3-longrope":
        pytest.skip("LongRoPE only")
    from kvserve import LLM, SamplingParams

    prompt = torch.randint(3, VOCAB, (SHORT_PROMPT,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    _, (expected,) = hf_reference(family["hf_model"], [prompt], NEW_TOKENS)
    llm = LLM(model=str(family["dir"]), dtype="float32", max_model_len=ORIGINAL,
              engine_core="thread")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert result[0].outputs[0].token_ids == expected


@pytest.mark.slow
def test_converted_gguf_loads_as_the_hf_directory(family, tmp_path, monkeypatch):
    """The checkpoint through llama.cpp's own convert_hf_to_gguf.py: YaRN's keys, Llama 3's
    `rope_freqs` tensor (its scaling baked into per-pair divisors), Phi-3's LongRoPE factor
    tensors, attention factor and rope.dimension_count: the same config, RoPE table and HF's
    logits, converted and then again with the parsed config cached (no weights are cached:
    the file's tensors are read as stored)."""
    from kvserve.kernels import get_ops

    path = convert_hf_to_gguf(family["dir"], tmp_path / f"{family['name']}.gguf")
    get_ops(True)  # loaded from the usual cache before the cache directory moves
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model, config = load_model(resolve_model(path), "float32", attention_backend="paged")
    from_hf, _ = load_model(resolve_model(family["dir"]), "float32", attention_backend="paged")
    # float32 in GGUF; the file's tokenizer names an EOS
    assert config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps)
    assert dataclasses.replace(config, rms_norm_eps=from_hf.config.rms_norm_eps,
                               eos_token_id=None) == from_hf.config
    torch.testing.assert_close(model.model.rotary_emb.cos_sin, from_hf.model.rotary_emb.cos_sin,
                               atol=1e-6, rtol=1e-5)
    _assert_match(_last_logits(model, family["prompts"]), family["logits"])
    # again, the config from the cache; the cache holds no second copy of the weights
    cached, _ = load_model(resolve_model(path), "float32", attention_backend="paged")
    assert any((tmp_path / "cache").rglob("*.config.json"))
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
    _assert_match(_last_logits(cached, family["prompts"]), family["logits"])


@pytest.mark.slow
def test_engine_chunked_prefill_and_prefix_hits_match_hf(family):
    assert_engine_chunked_and_cached_match(family["dir"], family["prompts"], family["tokens"],
                                           NEW_TOKENS)
