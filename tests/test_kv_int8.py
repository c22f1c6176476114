"""The int8 KV cache (`--kv-cache-dtype int8`): rows of head_dim int8 codes and a float32 scale.
The compiled kernels write the reference's bytes and attend within rounding of the reference
over the same rows, at every instruction-set level the machine can execute; the engine's
features (prefix caching, chunked prefill, the flash path) give the same tokens with it."""

import pytest
import torch

from kvserve.kernels import reference
import tests.helpers as helpers


@pytest.fixture
def compiled(kernels):
    """Every kernel test here runs once per instruction-set level (conftest's `kernels`)."""
    return kernels


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
    helpers.assert_rope_and_cache_writes_the_reference_codes(compiled, torch.int8, act_dtype, dim)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 2.0)])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])  # 64, 128: register-blocked; 256: Gemma 3
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_over_int8_rows_matches_the_reference(act_dtype, dim, window, softcap,
                                                              compiled):
    helpers.assert_paged_attention_matches_the_reference(compiled, torch.int8, act_dtype, dim,
                                                         window, softcap)


def test_int8_attention_is_close_to_the_unquantized_values(compiled):
    largest, mean = helpers.quantized_attention_error(compiled, torch.int8)
    assert largest < 0.05 and mean < 0.01, (largest, mean)


@pytest.mark.parametrize("dim", [64, 128])
def test_flash_path_reads_int8_blocks_through_a_dequantized_copy(dim, compiled):
    helpers.assert_flash_path_reads_a_dequantized_copy(compiled, torch.int8, dim)


def test_kernels_refuse_rows_of_the_wrong_width(compiled):
    helpers.assert_kernels_refuse_rows_of_the_wrong_width(compiled, torch.int8)


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
    exact, quantized = helpers.kv_cache_perplexities(smollm_source, torch.int8)
    assert quantized != exact  # the int8 rows were read
    assert abs(quantized / exact - 1) < 0.005, (exact, quantized)


def test_chunked_prompts_give_their_tokens_again_over_cached_blocks(smollm_source, tokenizer):
    helpers.assert_chunked_prompts_give_their_tokens_again(smollm_source.path, tokenizer, "int8")


def test_int8_blocks_go_to_a_ram_tier_and_come_back(tiny_model_dir, tokenizer):
    helpers.assert_blocks_go_to_a_ram_tier_and_come_back(tiny_model_dir, tokenizer, "int8")


def test_attention_sink_key_shifts_requantize_int8_rows():
    """Keys written at p + 37 and rotated back equal the keys written at p within a few
    quantization steps (absmax / 127); values keep their bytes."""
    errors = helpers.sink_key_shift_errors(torch.int8)
    assert errors.max() <= 4 / 127 + 1e-6, errors.max()
