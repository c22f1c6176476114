"""DeepSeek-V3 and V2 (models/families/deepseek.py): multi-head latent attention with q LoRA
or without, a dense first layer, V3's group-limited sigmoid routing with the correction bias
and the routed scaling, V2's softmax routing (greedy, and group-limited), ungated shared
experts; a tiny random checkpoint made by HF transformers' own config and
model classes, against HF's forward pass in float32. The latent cache keeps one row of
kv_lora_rank + qk_rope_head_dim per token and layer."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_tensors import KVPageLayout
from kvserve.config import ModelConfig
from kvserve.model_source import resolve_model
from kvserve.models import load_model
from tests.helpers import (
    TINY_FAMILY_SHAPE,
    assert_engine_chunked_and_cached_match,
    assert_greedy_batched_and_alone,
    assert_last_logits_match_hf,
    hf_reference,
    save_hf_checkpoint,
)

transformers = pytest.importorskip("transformers")

NEW_TOKENS, MAX_LEN = 10, 256
# quantized latents: the largest logit error over the largest logit, measured on these
# checkpoints (random weights drawn at 0.5: activations far larger than a trained model's, and
# routing that flips experts on small changes): int8 0.032-0.047; fp8 e4m3 0.08-0.89 (0.89:
# deepseek_v3's 90-token prompt), its 4 significant bits against int8's ~7 at a row's largest
# values (a bf16 cache, 8 bits, gives 0.005-0.029 here)
LATENT_LOGIT_BOUNDS = {"int8": 0.08, "fp8": 1.0}
SHAPE = dict(TINY_FAMILY_SHAPE, num_hidden_layers=3, num_key_value_heads=4)
CASES = {
    # q LoRA, 8 routed experts in 4 groups (the best 2 kept), top-2, one shared expert
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SHAPE, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=MAX_LEN),
    # no q LoRA (V2-Lite's q_proj), YaRN with mscale_all_dim scaling the softmax too
    "deepseek_v3_yarn": lambda: transformers.DeepseekV3Config(
        **SHAPE, moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=3, n_group=2,
        topk_group=1, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        max_position_embeddings=MAX_LEN, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
            "beta_fast": 32, "beta_slow": 1}),
    # V2-Lite's routing: softmax, plain greedy top-k, not renormalised; no q LoRA
    "deepseek_v2_lite": lambda: transformers.DeepseekV2Config(
        **SHAPE, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, routed_scaling_factor=1.5,
        max_position_embeddings=MAX_LEN),
    # V2's group-limited greedy (a group rated by its best expert), with q LoRA
    "deepseek_v2_grouped": lambda: transformers.DeepseekV2Config(
        **SHAPE, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, max_position_embeddings=MAX_LEN),
}


def _is_v3(case) -> bool:
    return case["hf_config"].model_type == "deepseek_v3"


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, tokenizer):
    """The tiny checkpoint with a correction bias drawn large enough to change which experts
    are chosen (HF's model starts it at zeros, where it would test nothing), saved again and
    HF's reference computed with it."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_config = CASES[request.param]()
    hf_model = save_hf_checkpoint(hf_config, directory, tokenizer)
    generator = torch.Generator().manual_seed(2)
    for module in hf_model.modules():
        if hasattr(module, "e_score_correction_bias"):
            bias = module.e_score_correction_bias
            bias.copy_(0.4 * torch.randn(bias.shape, generator=generator))
    hf_model.save_pretrained(directory)
    prompts = [torch.randint(3, hf_config.vocab_size, (n,), generator=generator).tolist()
               for n in (40, 7, 90)]
    logits, tokens = hf_reference(hf_model, prompts, NEW_TOKENS)
    return {"name": request.param, "dir": directory, "hf_config": hf_config,
            "hf_model": hf_model, "prompts": prompts, "logits": logits, "tokens": tokens}


def _model(case, backend="paged", dtype="float32"):
    model, _ = load_model(resolve_model(case["dir"]), dtype, attention_backend=backend)
    return model


def test_the_config_reads_as_hf_reads_it(case):
    config = ModelConfig.from_hf_dict(case["hf_config"].to_dict())
    hf = case["hf_config"]
    assert config.kv_lora_rank == 16 and config.head_dim == hf.qk_rope_head_dim
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    if _is_v3(case):
        assert config.moe_scoring == "sigmoid" and config.moe_correction_bias
    else:
        assert config.moe_scoring == "softmax" and not config.moe_correction_bias
        assert not config.norm_topk_prob
    assert (config.moe_groups, config.moe_topk_groups) == (hf.n_group or 1, hf.topk_group or 1)
    assert config.shared_expert_intermediate_size == hf.n_shared_experts * 32
    assert config.routed_scaling_factor == hf.routed_scaling_factor


def test_the_cache_keeps_one_latent_row_a_token(case):
    """KV bytes per token and layer: the latent and the RoPE key, nothing per head."""
    model = _model(case)
    layouts = model.kv_page_layouts(torch.bfloat16)
    hf = case["hf_config"]
    assert layouts == [KVPageLayout(1, 1, hf.kv_lora_rank + hf.qk_rope_head_dim,
                                    torch.bfloat16)] * hf.num_hidden_layers
    assert layouts[0].bytes_per_token == 2 * (hf.kv_lora_rank + hf.qk_rope_head_dim)


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_logits_match_hf(case, backend):
    assert_last_logits_match_hf(_model(case, backend), case, MAX_LEN, 1e-4)


@pytest.mark.parametrize("threshold", [1, 8])
def test_the_expanded_form_matches_hf(case, threshold, monkeypatch):
    """Prompt chunks of EXPANDED_MIN_TOKENS or more attend in the expanded form (per-head keys
    and values from the latents, SDPA). Its default, 128, is past these prompts, so it is
    lowered: to 8, the 40- and 90-token prompts take it beside the 7-token one absorbed in
    the same batch; to 1, every step does, decodes over their cached context included. HF's
    logits within 1e-4 and its greedy tokens, batched and alone."""
    from kvserve.attention import latent

    monkeypatch.setattr(latent, "EXPANDED_MIN_TOKENS", threshold)
    model = _model(case)
    assert_last_logits_match_hf(model, case, MAX_LEN, 1e-4)
    assert_greedy_batched_and_alone(model, case["prompts"], case["tokens"], NEW_TOKENS, MAX_LEN)


def test_greedy_tokens_match_hf_batched_and_alone(case):
    assert_greedy_batched_and_alone(_model(case), case["prompts"], case["tokens"], NEW_TOKENS,
                                    MAX_LEN)


def test_the_correction_bias_binds(case):
    """The fixture's bias changes HF's choices: without it, ours differ."""
    if not _is_v3(case):
        pytest.skip("V3's correction bias")
    model = _model(case)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data.zero_()
    with pytest.raises(AssertionError):
        assert_last_logits_match_hf(model, case, MAX_LEN, 1e-2)


def test_routing_spreads_over_groups_and_experts(case):
    """Routing that matters: a prompt's tokens take all experts but at most one (the bias
    may keep one out) in differing top-k sets, and never an expert outside their kept
    groups."""
    model = _model(case)
    moe = next(m for m in model.modules() if type(m).__name__ == "GroupLimitedMoE")
    hidden = model.model.embed(torch.tensor(case["prompts"][2]))
    weights, experts = moe.route(hidden)
    assert len(set(experts.flatten().tolist())) >= moe.num_experts - 1
    assert len({tuple(sorted(row)) for row in experts.tolist()}) > 1
    groups_taken = {len({e // (moe.num_experts // moe.groups) for e in row})
                    for row in experts.tolist()}
    assert max(groups_taken) <= moe.topk_groups
    if _is_v3(case):  # renormalised, then scaled
        torch.testing.assert_close(weights.sum(dim=-1),
                                   torch.full((len(hidden),), moe.routed_scaling_factor))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_layer_routes_as_the_python_loop(case, dtype):
    """The C++ mixture with DeepSeek's routing (`set_group_limited_routing`): the same experts
    for every token (the routed-token counters agree) and the same output as the Python loop,
    to float rounding, over a prompt's tokens."""
    model = _model(case, dtype=dtype)
    moe = next(m for m in model.modules() if type(m).__name__ == "GroupLimitedMoE")
    kernels = model.kernel_ops
    assert moe.fused(kernels) is not None
    hidden = model.model.embed(torch.tensor(case["prompts"][2])).to(getattr(torch, dtype))
    moe.routed_tokens = None
    expected = moe.run_loop(model.model.layer_ops, hidden)
    loop_counts = moe.routed_tokens.clone()
    moe.routed_tokens.zero_()
    moe.reset_fused()
    got = moe.fused(kernels).forward(hidden)
    assert torch.equal(moe.routed_tokens, loop_counts)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.slow
def test_engine_chunked_prefill_and_prefix_hits_match_hf(case):
    assert_engine_chunked_and_cached_match(case["dir"], case["prompts"], case["tokens"],
                                           NEW_TOKENS)


@pytest.mark.parametrize("kernels", ["compiled", "reference"])
def test_a_decode_step_reads_only_latents(case, kernels):
    """Every tensor a decode step makes, recorded under a dispatch mode: none holds a key or
    value per head for the context's tokens (a context-long dim beside a heads dim and a head
    dim), which the expanded form would. The torch reference gathers the cached rows it reads,
    latent-wide; the C++ kernel reads them in place and makes no context-long tensor at all
    (its arguments are the rows and the queries in latent space)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvserve.models.paged_loop import PagedLoop

    hf = case["hf_config"]
    model, _ = load_model(resolve_model(case["dir"]), "float32", attention_backend="paged",
                          use_cpu_kernels=kernels == "compiled")
    prompt = case["prompts"][2]
    context = len(prompt) + 1  # a length no weight has
    loop = PagedLoop(model, 1, MAX_LEN)
    first = int(loop.step([prompt], [len(prompt)], [0])[0].argmax())
    shapes: list[tuple[int, ...]] = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    shapes.append(tuple(tensor.shape))
            return out

    with Shapes():
        loop.step([[first]], [context], [0])
    per_head = {hf.qk_nope_head_dim, hf.v_head_dim, hf.qk_nope_head_dim + hf.qk_rope_head_dim}
    long = [shape for shape in shapes if context in shape]
    if kernels == "reference":
        assert (context, hf.kv_lora_rank + hf.qk_rope_head_dim) in long  # the latent rows read
    else:
        assert not long
    expanded = [shape for shape in long if hf.num_attention_heads in shape
                and per_head & set(shape) - {context, hf.num_attention_heads}]
    assert not expanded


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_latents_stay_close(case, kv_cache_dtype):
    """`--kv-cache-dtype int8` or `fp8`: the latent and the RoPE key each quantized per row
    with its float32 scale (2 x 4 bytes a row beside the codes); last-position logits near
    HF's."""
    from kvserve.models.paged_loop import PagedLoop
    from kvserve.platform import kv_cache_dtype as resolve

    hf = case["hf_config"]
    model = _model(case)
    row_dtype = resolve(kv_cache_dtype, torch.float32, False, "cpu")
    layout = model.kv_page_layouts(row_dtype)[0]
    assert layout.bytes_per_token == hf.kv_lora_rank + hf.qk_rope_head_dim + 8
    loop = PagedLoop(model, len(case["prompts"]), MAX_LEN, kv_dtype=row_dtype)
    logits = loop.step(case["prompts"], [len(p) for p in case["prompts"]],
                       list(range(len(case["prompts"]))))
    worst = max(float((got - want).abs().max() / want.abs().max())
                for got, want in zip(logits, case["logits"]))
    assert worst < LATENT_LOGIT_BOUNDS[kv_cache_dtype], worst


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite"])
def test_converted_gguf_loads_as_the_hf_directory(name, tmp_path, tokenizer, monkeypatch):
    """llama.cpp's converter's deepseek2 file (MLA written as one KV head of the latent's width,
    kv_b_proj split into attn_k_b and attn_v_b, the gating function telling V3 from V2) gives
    the HF directory's MLA and routing fields and its logits: float32 to 1e-4; as Q8_0 blocks
    (the halves dequantized and joined again, the projections kept as stored and run by the
    dequantizing GEMM), the same file dequantized to float32 within 1e-3. V3's hub configs say `scoring_func: sigmoid`, which
    the converter reads (transformers' own config class does not write it)."""
    import json

    from kvserve.models.paged_loop import PagedLoop
    from tests.helpers import convert_hf_to_gguf

    monkeypatch.setenv("KVSERVE_AUTOTUNE", "0")
    directory = tmp_path / name
    save_hf_checkpoint(CASES[name](), directory, tokenizer)
    if name == "deepseek_v3":
        config = json.loads((directory / "config.json").read_text())
        config.update(scoring_func="sigmoid", topk_method="noaux_tc")
        (directory / "config.json").write_text(json.dumps(config))
    hf_dir = _model({"dir": directory})
    prompt = list(range(5, 45))
    expected = PagedLoop(hf_dir, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
    fields = ("architecture", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "head_dim", "moe_scoring", "moe_groups", "moe_topk_groups", "moe_layers",
              "routed_scaling_factor", "norm_topk_prob", "shared_expert_intermediate_size",
              "moe_correction_bias", "attention_scale")
    for outtype in ("f32", "q8_0"):
        path = convert_hf_to_gguf(directory, tmp_path / f"{name}-{outtype}.gguf", outtype)
        model, config = load_model(resolve_model(path), "float32", attention_backend="paged",
                                   quantization="gguf" if outtype == "q8_0" else "none")
        assert config.source_weight_type == outtype.upper()  # "auto" keeps Q8_0 as stored
        assert [getattr(config, f) for f in fields] == \
            [getattr(hf_dir.config, f) for f in fields]
        if outtype == "f32":
            got = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            continue
        stored = [m for m in model.modules() if type(m).__name__ == "StoredLinear"]
        assert stored
        for module in stored:  # the dequantizing GEMM: the same sums as the float file's
            module.max_rows = 0
        got = PagedLoop(model, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
        dequantized, _ = load_model(resolve_model(path), "float32", attention_backend="paged")
        reference = PagedLoop(dequantized, 1, MAX_LEN).step([prompt], [len(prompt)], [0])[0]
        torch.testing.assert_close(got, reference, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_preemption_and_a_ram_tier_give_hf_tokens(case):
    """Through the engine with a pool too small for the three prompts together (requests
    preempted and their latents computed again), then with a RAM tier: the prompts' latent
    blocks evicted from the pool by others come back from the tier as cached tokens. HF's
    greedy tokens every time."""
    from kvserve import LLM, SamplingParams

    if case["name"] != "deepseek_v3":
        pytest.skip("one case is enough for the engine's bookkeeping")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in case["prompts"]]
    with LLM(model=str(case["dir"]), dtype="float32", num_kv_blocks=9, block_size=16,
             max_num_batched_tokens=32, engine_core="thread") as llm:
        results = llm.generate(requests, params, use_tqdm=False)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [r.outputs[0].token_ids for r in results] == case["tokens"]
    others = [[(7 * i + 3 * j) % 40000 + 5 for j in range(96)] for i in range(2)]
    with LLM(model=str(case["dir"]), dtype="float32", num_kv_blocks=16, block_size=16,
             max_model_len=128, engine_core="thread", kv_offload_ram_bytes=8 << 20,
             kv_offload_load_policy="always") as llm:
        llm.generate(requests[2], params, use_tqdm=False)
        llm.generate([{"prompt_token_ids": p} for p in others], params, use_tqdm=False)
        again = llm.generate(requests[2], params, use_tqdm=False)[0]
        stats = llm.llm_engine.engine_core.scheduler.connector.stats
    assert again.outputs[0].token_ids == case["tokens"][2]
    assert again.num_cached_tokens >= 64 and stats["loaded_blocks"] > 0
