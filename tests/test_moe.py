"""Mixtures of experts (models/layers/moe.py, models/families/moe.py, gpt_oss.py): Mixtral,
Qwen2-MoE (a shared expert with its sigmoid gate, a dense layer beside the sparse ones), Qwen3-MoE
(QK-norm, renormalised top-k), OLMoE (QK-norm over whole projections, Q/K/V clamped) and gpt-oss
(attention sinks, sliding and full layers, biases, the clamped SwiGLU, MXFP4 experts), each a tiny
random checkpoint made by HF transformers' own config and model classes, against HF's forward
pass in float32: logits within 1e-4 on each attention path, greedy tokens equal to HF's
`generate` batched and alone, through the engine with chunked prefill and prefix hits, int8
experts, bfloat16; each converted by llama.cpp's converter (float, and Q8_0 kept as stored).
Tensor parallelism: tests/test_tensor_parallel.py. The router's weights are large enough that
the tokens of one prompt spread over every expert and pick different top-k sets (checked: a
test whose tokens all took one expert would not test routing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model_source import resolve_model
from kvserve.models import load_model
from tests.helpers import (
    TINY_FAMILY_SHAPE,
    assert_engine_chunked_and_cached_match,
    assert_greedy_batched_and_alone,
    assert_last_logits_match_hf,
    decode_logits,
    tiny_family_case,
)

transformers = pytest.importorskip("transformers")

NEW_TOKENS, MAX_LEN = 10, 256
# the compiled kernels sum each expert's few rows in another order than HF's GEMM: on logits up
# to ~20 (the routers' and projections' weights drawn large so routing spreads) measured up to
# 3e-4 on the paged path, 7e-5 on the torch reference (the bound test_gguf_stored states for the
# same sums at scale)
TOLERANCE = {"torch_ref": 1e-4, "paged": 1e-3}
SHAPE = dict(TINY_FAMILY_SHAPE, head_dim=16, num_hidden_layers=3)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4,
                                                  num_experts_per_tok=2),
    # layer 1 dense (mlp_only_layers), a shared expert beside 6 routed, top-3 not renormalised
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, mlp_only_layers=[1]),
    # QK-norm over whole projections, Q/K/V clamped (small enough to bind here), top-3 of 5
    "olmoe": lambda: transformers.OlmoeConfig(**SHAPE, num_experts=5, num_experts_per_tok=3,
                                              clip_qkv=4.0),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
        norm_topk_prob=True),
    # a window the 40- and 90-token prompts pass, sliding and full layers, YaRN (its default)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SHAPE, num_local_experts=6, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    return tiny_family_case(request.param, FAMILIES[request.param](),
                            tmp_path_factory.mktemp(request.param), tokenizer, (40, 7, 90),
                            NEW_TOKENS)


def _model(case, backend="paged", dtype="float32", **options):
    model, _ = load_model(resolve_model(case["dir"]), dtype, attention_backend=backend,
                          **options)
    return model


def test_configs_read_as_hf_reads_them():
    mixtral = ModelConfig.from_hf_dict(FAMILIES["mixtral"]().to_dict())
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == \
        (4, 2, True)
    assert mixtral.moe_intermediate_size == SHAPE["intermediate_size"]
    qwen2 = ModelConfig.from_hf_dict(FAMILIES["qwen2_moe"]().to_dict())
    assert [qwen2.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert qwen2.attention_bias and qwen2.shared_expert_intermediate_size == 80
    assert not qwen2.norm_topk_prob
    stepped = FAMILIES["qwen3_moe"]().to_dict() | {"decoder_sparse_step": 2}
    assert [ModelConfig.from_hf_dict(stepped).is_moe_layer(i) for i in range(3)] == \
        [False, True, False]
    gpt_oss = ModelConfig.from_hf_dict(FAMILIES["gpt_oss"]().to_dict())
    assert (gpt_oss.num_experts, gpt_oss.num_experts_per_tok, gpt_oss.hidden_act) == \
        (6, 2, "swigluoai")
    assert gpt_oss.attention_sinks and gpt_oss.attention_output_bias and gpt_oss.moe_expert_bias
    assert gpt_oss.sliding_windows == (16, None, 16)
    assert gpt_oss.rope_scaling["rope_type"] == "yarn" and not gpt_oss.rope_scaling["truncate"]
    for config in (mixtral, qwen2, gpt_oss):
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_tokens_spread_over_the_experts(family):
    """Routing that matters: every expert takes some of a prompt's tokens, and the tokens'
    top-k sets differ."""
    model = _model(family)
    moe = next(m for m in model.modules() if type(m).__name__ == "SparseMoE")
    hidden = model.model.embed(torch.tensor(family["prompts"][2]))
    _, experts = moe.route(hidden)
    assert set(experts.flatten().tolist()) == set(range(moe.num_experts))
    assert len({tuple(sorted(row)) for row in experts.tolist()}) > moe.num_experts // 2


def test_the_olmoe_clamp_binds(family):
    """The fixture's clip_qkv changes HF's logits, so matching them tests the clamp."""
    if family["name"] != "olmoe":
        pytest.skip("OLMoE only")
    model = _model(family)
    for module in model.modules():
        if hasattr(module, "clip_qkv"):
            module.clip_qkv = None
    with pytest.raises(AssertionError):
        assert_last_logits_match_hf(model, family, MAX_LEN, 1e-2)


def test_the_gpt_oss_sinks_and_clamp_bind(family):
    """The fixture's sinks (drawn at initializer_range) and swigluoai's clamp change HF's
    logits, so matching them tests both: without either, ours differ."""
    if family["name"] != "gpt_oss":
        pytest.skip("gpt-oss only")
    for undo in ("sinks", "clamp"):
        model = _model(family)
        for module in model.modules():
            if undo == "sinks" and getattr(module, "sinks", None) is not None:
                module.sinks.data.fill_(float("-inf"))  # a sink that never weighs
            if undo == "clamp" and hasattr(module, "swiglu_limit"):
                module.swiglu_limit = float("inf")
            if hasattr(module, "reset_fused"):
                module.reset_fused()
        with pytest.raises(AssertionError):
            assert_last_logits_match_hf(model, family, MAX_LEN, 1e-2)


def test_gpt_oss_decodes_as_hf_on_the_other_attention_backends(family):
    """The sinks on the reference and batched-SDPA backends' decode paths too (the paged
    kernel's are every other test's): HF's greedy tokens batched and alone."""
    if family["name"] != "gpt_oss":
        pytest.skip("gpt-oss only")
    for backend in ("torch_ref", "sdpa_batched"):
        assert_greedy_batched_and_alone(_model(family, backend), family["prompts"],
                                        family["tokens"], NEW_TOKENS, MAX_LEN)


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_logits_match_hf(family, backend):
    tolerance = TOLERANCE[backend]
    if (family["name"], backend) == ("qwen2_moe", "torch_ref"):
        # four experts' outputs summed a layer, logits up to 17: ATen's float32 GEMMs on Zen 5
        # sum in another order than on Intel, measured 1.4-1.7e-4 from HF (1e-5 of the
        # largest logit; the other families 1e-5 to 8e-5)
        tolerance = 2e-4
    assert_last_logits_match_hf(_model(family, backend), family, MAX_LEN, tolerance)


def test_greedy_tokens_match_hf_batched_and_alone(family):
    assert_greedy_batched_and_alone(_model(family), family["prompts"], family["tokens"],
                                    NEW_TOKENS, MAX_LEN)


def test_int8_experts_stay_close(family):
    """The experts' projections convert like any other (`--quantization int8`): logits
    within int8's error of HF's. Cosine similarity, measured 0.93-0.999 (the dense families'
    0.994-1.0): on these wide random weights int8's error swaps some tokens' k-th and
    (k+1)-th experts, so no elementwise bound; experts mixed up would give ~0."""
    model = _model(family, quantization="int8")
    experts = [m for m in model.modules() if type(m).__name__ == "GatedMLP"]
    assert all(type(e.down_proj.method).__name__ == "ConvertMethod" for e in experts)
    from kvserve.models.paged_loop import PagedLoop

    prompts = family["prompts"]
    got = PagedLoop(model, len(prompts), MAX_LEN).step(prompts, [len(p) for p in prompts],
                                                     list(range(len(prompts))))
    for ours, theirs in zip(got, family["logits"]):
        similarity = torch.cosine_similarity(ours.float(), theirs, dim=0)
        assert similarity > 0.9


def test_bfloat16_stays_close(family):
    """In bfloat16 (the default activations on BF16 CPUs): the router in bf16, its softmax
    and the experts' weighted sum in float32; logits close to HF's float32 (cosine). Rounding
    swaps some tokens' experts on these wide random weights: HF's own bfloat16 model measures
    0.913 against its float32 on one Qwen2-MoE prompt (0.996-0.9998 on the others); ours
    0.888 there."""
    from kvserve.models.paged_loop import PagedLoop

    model, _ = load_model(resolve_model(family["dir"]), "bfloat16", attention_backend="paged")
    prompts = family["prompts"]
    got = PagedLoop(model, len(prompts), MAX_LEN).step(prompts, [len(p) for p in prompts],
                                                     list(range(len(prompts))))
    similarity = [torch.cosine_similarity(ours.float(), theirs, dim=0).item()
                  for ours, theirs in zip(got, family["logits"])]
    assert min(similarity) > 0.85 and sum(similarity) / len(similarity) > 0.95


@pytest.mark.slow
def test_engine_chunked_prefill_and_prefix_hits_match_hf(family):
    assert_engine_chunked_and_cached_match(family["dir"], family["prompts"], family["tokens"],
                                           NEW_TOKENS)


def _moe_fields(config) -> tuple:
    return (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.shared_expert_intermediate_size, config.moe_layers,
            config.qk_norm, config.attention_bias)


# llama.cpp's converter leaves no layer of a qwen2moe file dense, and writes no clip_qkv
GGUF_FAMILIES = dict(FAMILIES, qwen2_moe=lambda: transformers.Qwen2MoeConfig(
    **SHAPE, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
    shared_expert_intermediate_size=80),
    olmoe=lambda: transformers.OlmoeConfig(**SHAPE, num_experts=5, num_experts_per_tok=3))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_converted_gguf_loads_as_the_hf_directory(name, tmp_path, tokenizer, monkeypatch):
    """llama.cpp's converter's file (Mixtral as "llama" with experts; qwen2moe, qwen3moe; each
    layer's experts as one [experts, rows, cols] tensor) gives the HF directory's config and
    logits: float32 to 1e-4; as Q8_0 blocks kept as stored (each expert's rows of the
    experts tensor, the dequantizing GEMM: row limit 0), the same file dequantized to float32
    within 1e-3."""
    from kvserve.models.paged_loop import PagedLoop
    from tests.helpers import convert_hf_to_gguf, save_hf_checkpoint

    # the row limits set below stay (the background autotuner would set its own)
    monkeypatch.setenv("KVSERVE_AUTOTUNE", "0")
    directory = tmp_path / name
    save_hf_checkpoint(GGUF_FAMILIES[name](), directory, tokenizer)
    hf_dir, _ = load_model(resolve_model(directory), "float32", attention_backend="paged")
    prompt = list(range(5, 45))
    expected = PagedLoop(hf_dir, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    for outtype in ("f32", "q8_0"):
        path = convert_hf_to_gguf(directory, tmp_path / f"{name}-{outtype}.gguf", outtype)
        model, config = load_model(resolve_model(path), "float32", attention_backend="paged",
                                   quantization="gguf" if outtype == "q8_0" else "none")
        assert config.architecture == name
        assert _moe_fields(config) == _moe_fields(hf_dir.config)
        if outtype == "f32":
            got = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            _assert_damaged_gguf_fails(path, tmp_path)
            if name == "gpt_oss":
                _assert_mxfp4_experts_kept_as_stored(path, tmp_path, prompt)
            continue
        stored = [m for m in model.modules() if type(m).__name__ == "StoredLinear"]
        expert = next(m for m in model.modules() if type(m).__name__ == "GatedMLP")
        assert expert.gate_up_proj.impl in stored  # (a width of 48 or 40 stays F32 in the file)
        PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])  # the q8 kernel's
        for module in stored:  # the fused layers copied the old limits: binding the next
            module.max_rows = 0  # loop's cache rebuilds them (as a changed limit does)
        got = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
        dequantized, _ = load_model(resolve_model(path), "float32", attention_backend="paged")
        reference = PagedLoop(dequantized, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
        torch.testing.assert_close(got, reference, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_metrics_count_the_tokens_routed_to_each_expert(tmp_path, tokenizer):
    """`kvserve:moe_expert_routed_tokens` per MoE layer and expert: each layer's total is
    top-k times the tokens the model ran (warm-up, a prompt, its decode steps, a second
    prompt), reported about once a second from the worker; the dense layer has none."""
    import time

    import httpx
    import prometheus_client.parser

    from kvserve.testing.server import ServerProcess
    from tests.helpers import save_hf_checkpoint, tiny_server_flags

    save_hf_checkpoint(FAMILIES["qwen2_moe"](), tmp_path / "model", tokenizer)
    warm_up = 4 + 1  # the core's warm-up request: a 4-token prompt, one decode step
    first, new_tokens, second = list(range(5, 35)), 8, list(range(40, 52))
    with ServerProcess(tiny_server_flags(tmp_path / "model"),
                       log_path=tmp_path / "server.log") as server:
        for prompt, tokens in ((first, new_tokens), (second, 1)):
            time.sleep(1.2)  # the next step reports (one a second at most)
            httpx.post(server.base_url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}).raise_for_status()
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
    per_layer: dict[str, dict[str, float]] = {}
    for family in prometheus_client.parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve:moe_expert_routed_tokens_total":
                per_layer.setdefault(sample.labels["layer"], {})[sample.labels["expert"]] = \
                    sample.value
    ran = warm_up + len(first) + new_tokens - 1 + len(second)
    assert sorted(per_layer) == ["0", "2"]  # layer 1 is dense
    for experts in per_layer.values():
        assert sum(experts.values()) == 3 * ran  # top-3
        assert set(experts) <= {str(e) for e in range(6)} and len(experts) > 3


def test_each_experts_quantized_rows_have_their_own_name():
    """An experts tensor's per-expert QuantizedRows are named apart: the packed-panel cache keys
    runs by name, and experts of one tensor would otherwise share a key."""
    import numpy as np

    from kvserve.quant.pack_cache import run_key
    from kvserve.weights.gguf_stored import _per_expert
    from kvserve.weights.quantized_rows import QuantizedRows

    whole = QuantizedRows("Q8_0", np.zeros((4 * 16, 34), np.uint8), 32, 32, "blk.0.ffn_up_exps")
    parts = [part for _, part in _per_expert("mlp.experts.{}.up_proj.weight", whole, 4)]
    assert len({run_key([part]) for part in parts}) == 4


def _fused_layers(model) -> list:
    return [m._fused[1] for m in model.modules()
            if type(m).__name__ == "SparseMoE" and m._fused is not None]


def test_fused_layer_matches_hf_at_every_isa_level(family, isa_level):
    """The fused C++ MoE (kernels/csrc/moe.cpp: routing, grouped experts, the weighted sum) at
    each instruction-set level: HF's logits and greedy tokens, batched and alone."""
    model = _model(family)
    assert_last_logits_match_hf(model, family, MAX_LEN, TOLERANCE["paged"])
    assert all(layer is not None for layer in _fused_layers(model)) and _fused_layers(model)
    assert_greedy_batched_and_alone(model, family["prompts"], family["tokens"], NEW_TOKENS,
                                    MAX_LEN)


# (dtype, quantization): the experts' projection kinds the fused layer runs (dense float, int4
# panels, bf16 panels, int4 weights with int8 activations)
FUSED_MODES = [("float32", "none"), ("float32", "int4"), ("bfloat16", "none"),
               ("bfloat16", "w4a8")]


@pytest.mark.parametrize("dtype,quantization", FUSED_MODES)
def test_fused_layer_equals_the_python_loop(family, dtype, quantization, monkeypatch):
    """`KVSERVE_FUSED_MOE=0` (the switch) runs models/layers/moe.py's Python loop over the
    same projections: the same greedy tokens, logits within float32's summation order (the
    fused layer adds the weighted expert outputs with FMAs; measured up to 9e-4 after ten steps
    on logits up to ~20, the compiled kernels' bound against HF in TOLERANCE; gpt-oss below)."""
    config = ModelConfig.from_hf_dict(family["hf_config"].to_dict())
    widths = (config.moe_intermediate_size, config.shared_expert_intermediate_size or 32)
    if quantization != "none" and any(width % 32 for width in widths):
        pytest.skip("4-bit groups of 32: this family's expert widths are not multiples")
    prompts = family["prompts"]
    fused_model = _model(family, dtype=dtype, quantization=quantization)
    fused = decode_logits(fused_model, prompts, NEW_TOKENS, True, MAX_LEN)
    assert _fused_layers(fused_model) and None not in _fused_layers(fused_model)
    monkeypatch.setenv("KVSERVE_FUSED_MOE", "0")
    loop_model = _model(family, dtype=dtype, quantization=quantization)
    loop = decode_logits(loop_model, prompts, NEW_TOKENS, True, MAX_LEN)
    assert _fused_layers(loop_model) == [None] * len(_fused_layers(loop_model))
    assert torch.equal(fused.argmax(-1), loop.argmax(-1))
    # gpt-oss: 8e-5 on the prompt's logits, growing to 7e-3 by the tenth step (its sinks and
    # biases drawn large; the same ops, summed in another order)
    atol = 1e-2 if family["name"] == "gpt_oss" else TOLERANCE["paged"]
    torch.testing.assert_close(fused, loop, atol=atol if dtype == "float32" else 0.1, rtol=0)


def test_grouped_experts_give_the_bits_of_their_own_calls(family, monkeypatch):
    """Every active expert's projections in one parallel region each (x quantized once, the
    panels of every expert split over the threads) against `KVSERVE_GROUPED_MOE=0`, each
    expert's own projection calls: the same logits to the bit, through prefill (up to ~70 rows
    an expert) and decode. With int8 activations (w4a8: the integer-dot kernels the grouping
    schedules), also with every other expert's gate_up limited to 2 rows, so that in prefill
    some experts run grouped and the others through their own (dense) calls."""
    config = ModelConfig.from_hf_dict(family["hf_config"].to_dict())
    widths = (config.moe_intermediate_size, config.shared_expert_intermediate_size or 32)
    if any(width % 32 for width in widths):
        pytest.skip("4-bit groups of 32: this family's expert widths are not multiples")
    monkeypatch.setenv("KVSERVE_AUTOTUNE", "0")  # the row limits set below stay

    def logits(limit_some: bool):
        model = _model(family, dtype="bfloat16", quantization="w4a8")
        if limit_some:
            for moe in (m for m in model.modules() if type(m).__name__ == "SparseMoE"):
                for expert in moe.experts[::2]:
                    expert.gate_up_proj.impl.max_rows = 2
        result = decode_logits(model, family["prompts"], 3, True, MAX_LEN)
        assert _fused_layers(model) and None not in _fused_layers(model)
        return result

    for limit_some in (False, True):
        monkeypatch.delenv("KVSERVE_GROUPED_MOE", raising=False)
        grouped = logits(limit_some)
        monkeypatch.setenv("KVSERVE_GROUPED_MOE", "0")
        assert torch.equal(grouped, logits(limit_some))


def test_grouped_k_quant_experts_take_superblocks_as_their_own_calls(kernels):
    """GGUF K-quant experts (Q4_K gate_up, Q6_K down, K = 256) grouped: an expert with 8 rows
    or more takes the super-block kernel, one with fewer the per-group one, each expert's rows
    quantized the way its kernel wants: the output equals the per-expert calls' (each through
    gguf_linear_int) to the bit, and moves when the super-blocks are switched off."""
    from kvserve.kernels import reference

    experts, hidden, inter, tokens = 8, 256, 256, 40
    generator = torch.Generator().manual_seed(0)

    def projection(qtype: str, rows: int, cols: int):
        raw = torch.randint(0, 256, (rows, cols // 256 * reference.GGUF_FORMATS[qtype][1]),
                            dtype=torch.uint8, generator=generator)
        blocks = raw.view(rows, cols // 256, -1)
        scale_at = 208 if qtype == "Q6_K" else 0
        for offset in (scale_at, 2) if qtype == "Q4_K" else (scale_at,):
            scale = (torch.rand(rows, cols // 256, generator=generator) * 1e-2).half()
            blocks[..., offset:offset + 2] = scale.view(torch.uint8).view(rows, cols // 256, 2)
        return kernels.StackLinear("gguf", kernels.gguf_pack(raw, qtype), torch.empty(0), None,
                                   rows, 1 << 30, qtype)

    gate_up = [projection("Q4_K", 2 * inter, hidden) for _ in range(experts)]
    down = [projection("Q6_K", hidden, inter) for _ in range(experts)]
    # a router that sends most tokens to experts 0-3 and few to 4-7: both kernels in one call
    router = torch.randn(experts, hidden, generator=generator)
    router[:4] *= 4
    x = torch.randn(tokens, hidden, generator=generator)

    def forward(grouped: bool) -> torch.Tensor:
        layer = kernels.MoeLayer(router, 2, True, "silu", gate_up, down,
                                 torch.zeros(experts, dtype=torch.int64), grouped=grouped)
        return layer.forward(x)

    counts = torch.zeros(experts, dtype=torch.int64)
    kernels.MoeLayer(router, 2, True, "silu", gate_up, down, counts).forward(x)
    assert (counts >= reference.SUPERBLOCK_MIN_ROWS).any()
    assert ((counts > 0) & (counts < reference.SUPERBLOCK_MIN_ROWS)).any()
    grouped = forward(True)
    assert torch.equal(grouped, forward(False))
    kernels.set_gguf_superblocks(False)
    try:
        assert not torch.equal(grouped, forward(True))
        assert torch.equal(forward(True), forward(False))
    finally:
        kernels.set_gguf_superblocks(True)


def test_the_decode_stack_runs_the_moe_layers(family):
    """Decode steps run the layers as one C++ program with the fused MoE as one instruction
    (and OLMoE's whole-projection QK-norm and clamp as two more): logits equal to the Python
    path's to the bit."""
    prompts = family["prompts"]
    model = _model(family)
    stacked = decode_logits(model, prompts, NEW_TOKENS, False, MAX_LEN)
    assert type(model.model._decode_stack).__name__ == "DecodeStack"
    assert torch.equal(stacked, decode_logits(model, prompts, NEW_TOKENS, True, MAX_LEN))


def _assert_mxfp4_experts_kept_as_stored(path, tmp_path, prompt) -> None:
    """gpt-oss's experts as MXFP4 blocks (what llama-quantize's MXFP4_MOE writes: gguf's own
    quantizer here) stay MXFP4 (`--quantization gguf`): through the dequantizing GEMM the
    logits of the same file dequantized to float32 (the values exact: the GEMM's inputs are
    the file's numbers); through the integer-dot kernel (int8 activations, as llama.cpp's), the
    same greedy token."""
    import gguf

    from kvserve.models.paged_loop import PagedLoop
    from tests.helpers import copy_gguf

    reader = gguf.GGUFReader(str(path))
    mxfp4, q8_0 = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.Q8_0
    # the LM head in Q8_0 too (`gguf` would make a float32 one int8): the same values both ways
    kinds = {t.name: mxfp4 if t.name.endswith("_exps.weight") else q8_0 for t in reader.tensors
             if t.name.endswith("_exps.weight") or t.name == "output.weight"}
    quantized = tmp_path / "gpt_oss-mxfp4.gguf"
    copy_gguf(path, quantized, {t.name: (gguf.quants.quantize(np.asarray(t.data), kinds[t.name]),
                                         kinds[t.name])
                                for t in reader.tensors if t.name in kinds})
    model, _ = load_model(resolve_model(quantized), "float32", attention_backend="paged",
                          quantization="gguf")
    expert = next(m for m in model.modules() if type(m).__name__ == "GatedMLP")
    assert [segment.qtype for segment in expert.gate_up_proj.impl.segments] == ["MXFP4"]
    dequantized, _ = load_model(resolve_model(quantized), "float32", attention_backend="paged")
    reference = PagedLoop(dequantized, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    integer = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    assert integer.argmax() == reference.argmax()
    for module in model.modules():
        if type(module).__name__ == "StoredLinear":
            module.max_rows = 0
    got = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


def _assert_damaged_gguf_fails(path, tmp_path) -> None:
    """The file without its first layer's down experts, or with one expert too few in them:
    a typed error at load naming the tensor."""
    import gguf

    from kvserve.errors import CorruptModelFileError
    from tests.helpers import copy_gguf

    name = "blk.0.ffn_down_exps.weight"
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    for damage in (None, tensor.data[:-1].copy()):
        damaged = tmp_path / "damaged.gguf"
        copy_gguf(path, damaged, {name: damage})
        with pytest.raises(CorruptModelFileError, match=r"blk\.0\.ffn_down_exps|"
                                                         r"layers\.0\.\w+\.experts"):
            load_model(resolve_model(damaged), "float32")


def _damaged_copy(case, tmp_path, edit, config_edit=None):
    """The case's HF directory copied with its safetensors edited (`edit(tensors)`) and its
    config.json (`config_edit(config)`)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "damaged"
    shutil.copytree(case["dir"], directory)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})
    if config_edit is not None:
        config = json.loads((directory / "config.json").read_text())
        config_edit(config)
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_checkpoint_that_disagrees_with_its_config_fails_naming_the_tensor(tmp_path,
                                                                             tokenizer):
    """Bad input fails at load, typed, naming what is wrong: an expert's tensor missing, a
    router with more experts than the config, an expert of another width, an expert past the
    config's count, more experts a token than there are."""
    from kvserve.errors import CorruptModelFileError
    from tests.helpers import save_hf_checkpoint

    config = FAMILIES["qwen3_moe"]()
    case = {"dir": tmp_path / "qwen3_moe"}
    save_hf_checkpoint(config, case["dir"], tokenizer)
    experts, hidden = config.num_experts, config.hidden_size
    width, layer = config.moe_intermediate_size, "model.layers.0.mlp"
    missing = f"{layer}.experts.3.down_proj.weight"
    wrong_shapes = {f"{layer}.gate.weight": torch.zeros(experts + 1, hidden),
                    f"{layer}.experts.1.gate_proj.weight": torch.zeros(width + 8, hidden),
                    f"{layer}.experts.{experts}.up_proj.weight": torch.zeros(width, hidden)}
    edits = {missing: lambda tensors: tensors.pop(missing)} | {
        name: lambda tensors, name=name, value=value: tensors.update({name: value})
        for name, value in wrong_shapes.items()}
    for index, (named, edit) in enumerate(edits.items()):
        directory = _damaged_copy(case, tmp_path / str(index), edit)
        with pytest.raises(CorruptModelFileError, match=named.replace(".", r"\.")):
            load_model(resolve_model(directory), "float32")
    directory = _damaged_copy(case, tmp_path / "top_k", lambda tensors: None,
                              lambda c: c.update(num_experts_per_tok=experts + 1))
    with pytest.raises(CorruptModelFileError, match=f"{experts + 1} experts per token"):
        load_model(resolve_model(directory), "float32")
