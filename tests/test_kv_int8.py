"""The int8 KV cache (`--kv-cache-dtype int8`): rows of head_dim int8 codes and a float32 scale.
The compiled kernels write the reference's bytes and attend within rounding of the reference
over the same rows, at every instruction-set level the machine can execute; the engine's
features (prefix caching, chunked prefill, the flash path) give the same tokens with it."""

import pytest
import torch

from kvserve.attention import build_attention_metadata
from kvserve.attention.paged import PagedBackend
from kvserve.kernels import reference
from tests.helpers import rope_both

HEADS, KV_HEADS = 6, 2


@pytest.fixture
def compiled(kernels):
    """Every kernel test here runs once per instruction-set level (conftest's `kernels`)."""
    return kernels


def _batch(act_dtype, query_lens, seq_lens, dim, block_size=4, seed=1):
    """Scattered block tables, an int8 cache holding quantized random K/V, random qkv."""
    torch.manual_seed(seed)
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens]
    ids = torch.randperm(sum(blocks_needed) + 3).tolist()
    tables, cursor = [], 0
    for count in blocks_needed:
        tables.append(ids[cursor:cursor + count])
        cursor += count
    metadata, positions = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    values = torch.randn(2, len(ids), block_size, KV_HEADS, dim) * 2
    kv_cache = reference.quantize_kv_rows(values.to(act_dtype))
    qkv = torch.randn(sum(query_lens), (HEADS + 2 * KV_HEADS) * dim, dtype=act_dtype)
    return metadata, positions, kv_cache, qkv


def test_rows_hold_codes_and_their_scale():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 40.0]).view(1, 3, 1)
    x[0, 0] = 0.0
    rows = reference.quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + reference.KV_SCALE_BYTES)
    assert reference.kv_row_width(64, torch.int8) == 68
    assert reference.kv_row_width(64, torch.bfloat16) == 64
    back = reference.dequantize_kv_rows(rows, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))  # an all-zero row stays zero
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= scale / 2 * (1 + 1e-6))  # half a step at most
    assert rows[..., :64].abs().max() == 127  # each row's largest value is a full code


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_writes_the_reference_bytes(act_dtype, dim, compiled):
    metadata, positions, kv_cache, qkv = _batch(act_dtype, [3, 1, 5], [3, 9, 12], dim)
    qkv2, cache2 = rope_both(compiled, metadata, positions, kv_cache, qkv, HEADS, KV_HEADS, dim)
    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(qkv.float(), qkv2.float(), atol=tol, rtol=tol)
    if act_dtype == torch.float32:  # the same float inputs: the same codes and scales
        assert torch.equal(kv_cache, cache2)
    else:  # bf16 RoPE may differ by a rounding, and move a code by one
        diff = (kv_cache[..., :dim].int() - cache2[..., :dim].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.05
    written = metadata.slot_mapping
    assert kv_cache[0].view(-1, KV_HEADS, dim + 4)[written].abs().sum() > 0


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 2.0)])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])  # 64, 128: register-blocked; 256: Gemma 3
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_over_int8_rows_matches_the_reference(act_dtype, dim, window, softcap,
                                                              compiled):
    # decode rows, a chunk over cached context, a fresh prompt, a long decode
    query_lens, seq_lens = [1, 4, 6, 1, 1], [7, 10, 6, 33, 1]
    metadata, _, kv_cache, qkv = _batch(act_dtype, query_lens, seq_lens, dim)
    seq_ids = torch.arange(len(query_lens), dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            HEADS, KV_HEADS, dim, dim**-0.5, window, softcap)
    out = torch.zeros(qkv.shape[0], HEADS * dim, dtype=act_dtype)
    expected = torch.zeros(qkv.shape[0], HEADS * dim)
    compiled.paged_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv.float(), kv_cache, expected, *args)
    tol = 1e-4 if act_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_int8_attention_is_close_to_the_unquantized_values(compiled):
    """The quantization's own error: attention over int8 rows stays near attention over the
    float values they came from (what the perplexity bound measures on the real model)."""
    torch.manual_seed(3)
    query_lens, seq_lens, dim = [1, 1, 8], [40, 90, 8], 64
    metadata, _, _, qkv = _batch(torch.float32, query_lens, seq_lens, dim)
    values = torch.randn(2, metadata.block_tables.max() + 1, 4, KV_HEADS, dim)
    seq_ids = torch.arange(3, dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            HEADS, KV_HEADS, dim, dim**-0.5, 0)
    exact, quantized = (torch.zeros(qkv.shape[0], HEADS * dim) for _ in range(2))
    reference.paged_attention_(qkv, values, exact, *args)
    compiled.paged_attention_(qkv, reference.quantize_kv_rows(values), quantized, *args)
    assert (quantized - exact).abs().max() < 0.05
    assert (quantized - exact).abs().mean() < 0.01


@pytest.mark.parametrize("dim", [64, 128])
def test_flash_path_reads_int8_blocks_through_a_dequantized_copy(dim, compiled):
    """Prompt chunks take the flash kernel with bf16 activations; over an int8 cache it reads
    the sequences' blocks dequantized (PagedBackend), within bf16 rounding of the reference."""
    if not compiled.flash_attention_supported(dim):
        pytest.skip(f"no flash kernel in the {compiled.isa} build")
    query_lens, seq_lens = [17, 1, 40, 5], [17, 50, 100, 9]
    metadata, _, kv_cache, qkv = _batch(torch.bfloat16, query_lens, seq_lens, dim)
    out = PagedBackend(compiled).attend(qkv, kv_cache, metadata, HEADS, KV_HEADS, dim,
                                        dim**-0.5)
    assert metadata.plan.flash_seq_ids.tolist() == [0, 2, 3]
    expected = torch.zeros(qkv.shape[0], HEADS * dim)
    reference.paged_attention_(qkv.float(), kv_cache, expected,
                               torch.arange(4, dtype=torch.int32),
                               metadata.query_start_loc.long(), metadata.seq_lens,
                               metadata.block_tables, HEADS, KV_HEADS, dim, dim**-0.5, 0)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_kernels_refuse_rows_of_the_wrong_width(compiled):
    metadata, positions, kv_cache, qkv = _batch(torch.float32, [1], [5], 32)
    with pytest.raises(RuntimeError, match="row"):
        compiled.rope_and_cache_(qkv, positions, torch.randn(16, 32), kv_cache[..., :32].clone(),
                                 metadata.slot_mapping, HEADS, KV_HEADS, 32)
    out = torch.zeros(1, HEADS * 32)
    with pytest.raises(RuntimeError, match="row"):
        compiled.paged_attention_(qkv, kv_cache[..., :32].clone(), out,
                                  torch.zeros(1, dtype=torch.int32),
                                  metadata.query_start_loc.long(), metadata.seq_lens,
                                  metadata.block_tables, HEADS, KV_HEADS, 32, 0.1, 0)


# ---- the engine with an int8 KV cache


def test_the_memory_per_token_is_about_halved(smollm_source):
    from kvserve.attention.kv_tensors import kv_bytes_per_block
    from kvserve.weights.loader import load_config

    config = load_config(smollm_source)
    bf16 = kv_bytes_per_block(config, 16, torch.bfloat16)
    int8 = kv_bytes_per_block(config, 16, torch.int8)
    assert int8 / bf16 == (config.head_dim + 4) / (2 * config.head_dim)  # 68 / 128 for SmolLM2


def test_int8_perplexity_stays_within_half_a_percent_of_float_kv(smollm_source):
    """Two held-out windows of 512 tokens scored with float32 activations over a float32 and an
    int8 KV cache (the full run, 22 windows: +0.09%, benchmarks/results)."""
    from kvserve.bench.perplexity import held_out_text, perplexity
    from kvserve.models import load_model
    from kvserve.tokenizer import load_tokenizer

    model, _ = load_model(smollm_source, "float32", attention_backend="paged")
    tokens = load_tokenizer(smollm_source).encode(held_out_text(), add_special_tokens=False)
    exact = perplexity(model, tokens, max_windows=2, kv_dtype=torch.float32)["perplexity"]
    quantized = perplexity(model, tokens, max_windows=2, kv_dtype=torch.int8)["perplexity"]
    assert quantized != exact  # the int8 rows were read
    assert abs(quantized / exact - 1) < 0.005, (exact, quantized)


def test_chunked_prompts_give_their_tokens_again_over_cached_blocks(smollm_source, tokenizer):
    """float32 activations over an int8 cache: prompts chunked by a 32-token budget give the
    same greedy tokens when served again over their cached blocks (the same kernels read the
    same codes), and begin as the prompts prefilled whole do. Not token for token to the end:
    the whole prompt's attention (SDPA) and the chunks' (the paged kernel) sum in different
    orders, and where float32 KV would differ in a last bit, a value near a rounding boundary
    can take the neighbouring int8 code; a near-tie then flips a later token (seen on the AVX2
    build at the 7th token of one prompt; float32 KV gives all 36 tokens equal there)."""
    from kvserve import LLM, SamplingParams

    from tests.helpers import long_text

    text = tokenizer.encode(long_text(), add_special_tokens=False)
    prompts = [{"prompt_token_ids": text[i * 90:(i + 1) * 90 + 40]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(model=str(smollm_source.path), dtype="float32", kv_cache_dtype="int8",
                  block_size=16, num_kv_blocks=64, max_model_len=256, engine_core="thread")
    with LLM(enable_prefix_caching=False, **common) as whole:
        expected = [r.outputs[0].token_ids for r in whole.generate(prompts, params,
                                                                   use_tqdm=False)]
    with LLM(enable_prefix_caching=True, max_num_batched_tokens=32, **common) as chunked:
        first = [r.outputs[0].token_ids for r in chunked.generate(prompts, params,
                                                                  use_tqdm=False)]
        again = [r.outputs[0].token_ids for r in chunked.generate(prompts, params,
                                                                  use_tqdm=False)]
        assert chunked.llm_engine.engine_core.kv_manager.stats.hits > 0
    assert again == first
    assert [tokens[:4] for tokens in first] == [tokens[:4] for tokens in expected]


def test_int8_blocks_go_to_a_ram_tier_and_come_back(tiny_model_dir, tokenizer):
    """Tiers copy whole blocks, codes and scales together: prefixes evicted from a small int8
    pool come back from the RAM tier as cached tokens with the roomy pool's tokens."""
    from kvserve import LLM, SamplingParams

    words = tokenizer.encode(" ".join(f"word{i}" for i in range(600)), add_special_tokens=False)
    prompts = [{"prompt_token_ids": words[i * 80:(i + 1) * 80]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8",
                  block_size=16, engine_core="thread")

    def run(engine, batch):
        return [engine.generate(p, params, use_tqdm=False)[0] for p in batch]

    with LLM(num_kv_blocks=256, enable_prefix_caching=False, **common) as roomy:
        expected = [o.outputs[0].token_ids for o in run(roomy, prompts)]
    with LLM(num_kv_blocks=16, max_model_len=128, kv_offload_ram_bytes=8 << 20,
             kv_offload_load_policy="always", **common) as small:
        first, again = run(small, prompts), run(small, prompts[:3])
        stats = small.llm_engine.engine_core.scheduler.connector.stats
    assert [o.outputs[0].token_ids for o in first + again] == expected + expected[:3]
    assert all(o.num_cached_tokens >= 64 for o in again)
    assert stats["loaded_blocks"] >= 12 and stats["failed_loads"] == 0


def test_attention_sink_key_shifts_requantize_int8_rows():
    """Streaming's key shift (attention sinks) on int8 rows: keys written at p + 37 and rotated
    back equal the keys written at p within a few quantization steps; values keep their bytes."""
    from kvserve.attention.kv_tensors import allocate_kv_caches
    from kvserve.models import random_model
    from kvserve.testing.tiny import tiny_config

    model = random_model(tiny_config(), "float32", seed=0)
    caches = allocate_kv_caches(model.kv_page_layouts(torch.int8), 8, 16)
    model.bind_kv_cache(caches)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))
    for table, offset in (([0, 1, 2], 37), ([4, 5, 6], 0)):
        metadata, positions = build_attention_metadata([40], [40], [table], 16)
        model(ids, positions + offset, metadata)
    values = [cache[1].clone() for cache in caches]
    model.shift_keys([0, 1, 2], -37)
    for cache, before in zip(caches, values):
        shifted, written = (cache[0, blocks].flatten(0, 1)[:40] for blocks in ([0, 1, 2],
                                                                               [4, 5, 6]))
        keys = [reference.dequantize_kv_rows(k, torch.float32) for k in (shifted, written)]
        step = keys[1].abs().amax(-1, keepdim=True) / 127
        assert torch.all((keys[0] - keys[1]).abs() <= 4 * step + 1e-6)
        assert torch.equal(cache[1], before)
