"""Quantized projections: exact recovery of Q4_1-style codes, each low-bit kernel against the
dense copy of the same weights, the default choice, and (slow) perplexity bounds on SmolLM2."""

import pytest
import torch
from torch import nn

from kvserve.engine_config import EngineConfig
from kvserve.kernels import get_ops, isa, reference
from kvserve.models import random_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.quant.linear import (
    INT4_KERNEL_MAX_ROWS,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    W8A8Linear,
    quantize_int4_groupwise,
    resolve_quantization,
)
from kvserve.testing.tiny import tiny_config
from tests.helpers import kernel_level


def test_int4_recovers_q4_1_codes_exactly():
    """A Q4_1 block is d * q + m with its min at code 0 and its max at code 15."""
    generator = torch.Generator().manual_seed(0)
    rows, groups = 8, 6
    codes = torch.randint(0, 16, (rows, groups, 32), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(rows, groups, generator=generator) * 0.01).half().float()
    m = (-torch.rand(rows, groups, generator=generator) * 0.1).half().float()
    weight = (d[..., None] * codes + m[..., None]).view(rows, -1)
    got_codes, scale, low = quantize_int4_groupwise(weight)
    assert torch.equal(got_codes.view(rows, groups, 32), codes.int())
    assert torch.equal(low, m)
    torch.testing.assert_close(scale, d, rtol=1e-6, atol=0)


def _linear(out_features=96, in_features=128, bias=False):
    torch.manual_seed(1)
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data.normal_(0, 0.05)
    return linear


@pytest.mark.parametrize("cls", [Int4WeightOnlyLinear, Int8WeightOnlyLinear])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_kernel_equals_its_dense_weights(cls, bias):
    """Small batches take the low-bit kernel, large ones the dense copy: same weights."""
    layer = cls(_linear(bias=bias), torch.bfloat16)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    low_bit = layer(x)  # 3 rows: the low-bit kernel
    dense = nn.functional.linear(x, layer.dense_weight, layer.bias)
    torch.testing.assert_close(low_bit.float(), dense.float(), atol=2e-2, rtol=2e-2)
    batched = layer(torch.cat([x] * 4))  # 12 rows: the dense path
    torch.testing.assert_close(batched[:3].float(), dense.float(), atol=2e-2, rtol=2e-2)




def _int4_weights(rows, cols, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=generator)
    scale = torch.rand(rows, cols // 32, generator=generator) * 0.02
    zero = torch.randn(rows, cols // 32, generator=generator) * 0.05
    return codes, scale, zero


def test_int4_pack_round_trips():
    """The kernel's panel layout unpacks to (q - 8) * scale + zero, odd row counts included."""
    codes, scale, zero = _int4_weights(37, 96)
    for meta_dtype in (torch.float32, torch.bfloat16):
        packed = reference.pack_int4(codes, scale, zero, meta_dtype)
        assert packed.shape == (3, 3, 320 if meta_dtype == torch.bfloat16 else 384)
        s, z = scale.to(meta_dtype).float(), zero.to(meta_dtype).float()
        expected = ((codes.view(37, 3, 32) - 8) * s[..., None] + z[..., None]).view(37, 96)
        assert torch.equal(reference.unpack_int4(packed, 37), expected)


@pytest.mark.parametrize("shape", [(37, 64), (96, 1536), (130, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_matches_dequantized_linear(shape, dtype, bias, kernels):
    """Against the fp32 linear of the dequantized weights, 1..17 and 25 rows (one pass of up to
    8 or 10 rows, two or three of equal size), both metadata dtypes. bf16: the output's rounding
    (<= 2^-9 relative) plus float accumulation-order noise; float32: accumulation order only
    (the kernel adds 128 to every code and takes it back per group, ~1e-6 relative)."""
    rows, cols = shape
    codes, scale, zero = _int4_weights(rows, cols, seed=cols)
    generator = torch.Generator().manual_seed(1)
    bias_values = torch.randn(rows, generator=generator).to(dtype) if bias else None
    tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-4
    for meta_dtype in (torch.bfloat16, torch.float32):
        packed = reference.pack_int4(codes, scale, zero, meta_dtype)
        weight = reference.unpack_int4(packed, rows)
        for m in [*range(1, 18), 25]:
            x = torch.randn(m, cols, generator=generator).to(dtype)
            expected = nn.functional.linear(x.float(), weight,
                                            None if bias_values is None else bias_values.float())
            got = kernels.int4_linear(x, packed, bias_values, rows)
            assert got.dtype == dtype and got.shape == (m, rows)
            torch.testing.assert_close(got.float(), expected, rtol=tolerance,
                                       atol=tolerance * expected.abs().max().item())
            ref = reference.int4_linear(x, packed, bias_values, rows)
            torch.testing.assert_close(ref.float(), expected, rtol=tolerance,
                                       atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_layer_with_compiled_ops_matches_reference_ops(dtype, kernels):
    """Compiled ops with a vectorised int4 kernel (every level but scalar): our kernel up to
    INT4_KERNEL_MAX_ROWS, the dense copy above, no torch int4 buffers. Reference ops: torch's
    int4 kernel / the dense copy, as before. Same outputs."""
    if not kernels.int4_linear_fast():
        pytest.skip(f"the {kernels.isa} build has no vectorised int4 kernel")
    linear = _linear(bias=True)
    ours = Int4WeightOnlyLinear(linear, dtype, kernels)
    theirs = Int4WeightOnlyLinear(linear, dtype, get_ops(False))
    assert ours.ops is kernels and not hasattr(ours, "packed")
    assert theirs.ops is None and not hasattr(theirs, "panels")
    assert ours.max_rows == INT4_KERNEL_MAX_ROWS
    torch.testing.assert_close(ours.dense_weight, theirs.dense_weight, rtol=0, atol=0)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for rows in (1, 3, 8, INT4_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 128).to(dtype)
        torch.testing.assert_close(ours(x).float(), theirs(x).float(), rtol=tolerance,
                                   atol=tolerance)


def test_w8a8_close_to_its_int8_weights(kernels):
    linear = _linear(bias=True)
    layer = W8A8Linear(linear, torch.bfloat16, kernels)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    dense = nn.functional.linear(x.float(), layer.codes.float() * layer.weight_scale[:, None],
                                 layer.bias.float())
    error = (layer(x).float() - dense).norm() / dense.norm()
    assert error < 0.02  # per-token int8 activations: ~0.5% here


def test_auto_keeps_a_ggufs_block_types_unless_float32_was_asked_for():
    assert resolve_quantization("auto", "Q4_1", torch.bfloat16) == "gguf"
    assert resolve_quantization("auto", "Q4_K", torch.bfloat16) == "gguf"
    assert resolve_quantization("auto", "Q6_K", torch.bfloat16) == "gguf"
    assert resolve_quantization("auto", "Q3_K", torch.bfloat16) == "gguf"  # layers -> w4a8
    assert resolve_quantization("int4", "Q4_1", torch.bfloat16) == "int4"
    assert resolve_quantization("auto", "Q4_1", torch.float32) == "none"  # the exact reference
    # float32 as the machine's default (no native bf16): the file's blocks too
    assert resolve_quantization("auto", "Q4_1", torch.float32, dtype_is_default=True) == "gguf"
    assert resolve_quantization("auto", "F32", torch.float32, dtype_is_default=True) == "none"
    assert resolve_quantization("auto", "BF16", torch.bfloat16) == "none"
    assert resolve_quantization("auto", None, torch.bfloat16) == "none"  # an HF directory


def test_auto_keeps_five_to_eight_bit_sources_as_stored():
    """Gemma 3 270M's mostly-Q5_0/Q6_K file: its own blocks (before, int8 per group: +0.6%
    perplexity), unless float32 was asked for; never off the CPU."""
    for source in ("Q5_0", "Q6_K", "Q8_0"):
        assert resolve_quantization("auto", source, torch.bfloat16) == "gguf"
        assert resolve_quantization("auto", source, torch.float32, dtype_is_default=True) == \
            "gguf"
        assert resolve_quantization("auto", source, torch.float32) == "none"
        assert resolve_quantization("auto", source, torch.bfloat16, device="cuda") == "none"


def test_four_bit_modes_refuse_other_devices_at_load():
    """int4 and w4a8 live in CPU-only packings (a GPU run failed inside torch's
    _convert_weight_to_int4pack_for_cpu): off the CPU `auto` keeps a 4-bit checkpoint
    dequantized, and asking for them is an error before any weight is loaded."""
    assert resolve_quantization("auto", "Q4_1", torch.bfloat16, device="cuda") == "none"
    assert resolve_quantization("auto", "Q4_1", torch.float32, True, device="cuda:0") == "none"
    assert resolve_quantization("int8", "Q4_1", torch.bfloat16, device="cuda") == "int8"
    for mode in ("int4", "w4a8", "gguf"):
        with pytest.raises(ValueError, match=f"'{mode}' runs on the CPU only"):
            resolve_quantization(mode, "Q4_1", torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="CPU only"):
            EngineConfig(quantization=mode, device="cuda")
    EngineConfig(quantization="int4", device="cpu")


@pytest.mark.parametrize("mode", ["int4", "int8", "w8a8"])
def test_quantized_model_one_row_equals_batched(mode):
    """The same prompt decoded alone (low-bit GEMVs) and among 19 others (dense / int8 GEMMs)
    gives logits within the mode's tolerance: the kernel choice does not change the model."""
    model = random_model(tiny_config(), "bfloat16", seed=3, attention_backend="paged",
                         quantization=mode)
    assert model.quantization == mode
    prompt = [(5 * i + 1) % 200 + 3 for i in range(12)]
    alone = PagedLoop(model, 1, 32).step([prompt], [12], [0])[0]
    others = [[(t + k) % 200 + 3 for t in prompt] for k in range(1, 20)]
    batched = PagedLoop(model, 20, 32).step([prompt] + others, [12] * 20, list(range(20)))[0]
    tolerance = 0.1 if mode == "w8a8" else 0.03
    assert (alone - batched).abs().max() <= tolerance * max(1.0, alone.abs().max().item())


@pytest.mark.slow
# w8a8's int8 GEMMs (torch._int_mm) have no fast path without VNNI: ~1 min a window on an
# AVX2-only CPU, several on a busy one; seconds with AVX512-VNNI
@pytest.mark.timeout(900)
def test_perplexity_bounds_on_smollm2(smollm_source):
    """The stated bounds (benchmarks/results/*-perplexity.md has the full 12-window table): int4
    and int8 within 1% of the unquantized model, w8a8 within 5%. On the first 512-token window
    of the held-out text (511 predictions), in the machine's default dtype: bfloat16 where the
    CPU multiplies bf16 natively, float32 elsewhere (emulated bf16 GEMMs are ~100x slower there:
    no test could wait for them).

    Measured on that window on Zen 3 (float32): int4 +0.00%, int8 +0.29%, w8a8 +3.27%. Over the
    first 4 windows (what this test scored before, ~4 min of w8a8 GEMMs alone on AVX2): +0.00%,
    +0.10%, +2.69%; w8a8 ranged +0.42% to +4.53% by window. In bfloat16 the table's 12 windows
    give w8a8 +4.05%; this window alone was not measured on a bf16 machine."""
    from kvserve.bench.perplexity import held_out_text, perplexity
    from kvserve.models import load_model
    from kvserve.platform import default_dtype
    from kvserve.tokenizer import load_tokenizer

    tokens = load_tokenizer(smollm_source).encode(held_out_text(), add_special_tokens=False)
    dtype = default_dtype("cpu")
    results = {}
    for mode in ("none", "int4", "int8", "w8a8"):
        model, _ = load_model(smollm_source, dtype, attention_backend="paged",
                              quantization=mode)
        results[mode] = perplexity(model, tokens, 512, max_windows=1)["perplexity"]
    assert results["int4"] <= results["none"] * 1.01
    assert results["int8"] <= results["none"] * 1.01
    assert results["w8a8"] <= results["none"] * 1.05


# The default path of each CPU family that has one (`--quantization auto` on a GGUF): kernel
# level -> the default activations' dtype there. The file's blocks (`gguf`) everywhere.
DEFAULT_CPU_PATHS = {"avx2": torch.float32,          # Zen 3
                     "avx512_vnni": torch.float32,   # Cascade Lake: VNNI, no bf16
                     "avx512_bf16": torch.bfloat16}  # Zen 4/5, Sapphire Rapids


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("level", [level for level in isa.tested_levels()
                                   if level in DEFAULT_CPU_PATHS])
def test_each_default_cpu_path_keeps_gguf_within_1pct_of_int4(smollm_source, level):
    """What `auto` runs on each CPU family (the level capped by KVSERVE_CPU_ISA, so any AVX-512
    machine runs all three): the file's Q4_1 and Q8_0 blocks with activations rounded to int8
    (`gguf`; w4a8's kernels and values on this file) in the level's default dtype, scored in
    decode-sized steps (16 tokens) against int4 scored the same way, over the first 4 windows
    (2,044 predictions).

    One window is not enough: w4a8 rounds activations to int8, and a last-bit difference
    upstream (an AVX2 and an AVX-512 RMSNorm sum in different orders) moves some of those
    roundings, which 30 layers then amplify. The same model and data measured +0.36% over int4
    at the AVX2 level and +1.17% at both AVX-512 levels on one window (the +1.17% a Cascade
    Lake reported), +0.13% and +0.40% over 4 windows (bf16: +0.51% on one, +0.21% on 4; Xeon
    family 6 model 207)."""
    from kvserve.bench.perplexity import held_out_text, perplexity
    from kvserve.models import load_model
    from kvserve.platform import default_dtype
    from kvserve.quant import resolve_quantization
    from kvserve.tokenizer import load_tokenizer

    tokens = load_tokenizer(smollm_source).encode(held_out_text(), add_special_tokens=False)
    with kernel_level(level):
        dtype = default_dtype("cpu")
        assert dtype == DEFAULT_CPU_PATHS[level]
        assert resolve_quantization("auto", "Q4_1", dtype, dtype_is_default=True) == "gguf"
        scored = {}
        for mode in ("int4", "gguf"):
            model, _ = load_model(smollm_source, dtype, attention_backend="paged",
                                  quantization=mode)
            scored[mode] = perplexity(model, tokens, 512, max_windows=4,
                                      chunk=16)["perplexity"]
    assert scored["gguf"] <= scored["int4"] * 1.01, scored


def test_int8_groupwise_recovers_q8_0_exactly_and_packs_round_trip():
    """A Q8_0 block is d * q with an fp16 d and its absmax code at +-127."""
    generator = torch.Generator().manual_seed(5)
    rows, groups = 21, 4
    codes = torch.randint(-127, 128, (rows, groups, 32), generator=generator).to(torch.int8)
    codes[..., 0] = 127
    d = (torch.rand(rows, groups, generator=generator) * 0.01 + 1e-4).half().float()
    weight = (codes.float() * d[..., None]).view(rows, -1)
    got_codes, scale = reference.quantize_int8_groupwise(weight)
    assert torch.equal(got_codes.view(rows, groups, 32), codes)
    assert torch.equal(scale, d)
    packed = reference.pack_int8(got_codes, scale)
    assert packed.shape == (2, groups, 576)
    assert torch.equal(reference.unpack_int8(packed, rows), weight)


@pytest.mark.parametrize("shape", [(37, 64), (130, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_kernel_matches_dequantized_linear(shape, dtype, kernels):
    """1..17 and 25 rows (one pass of up to 8 or 12 rows, two or three of equal size; bf16 x on
    vdpbf16ps from 3 rows where the CPU has it), a partial last panel, with and without bias."""
    rows, cols = shape
    generator = torch.Generator().manual_seed(cols)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    packed = reference.pack_int8(*reference.quantize_int8_groupwise(weight))
    _assert_kernel_matches_dense(kernels.int8_linear, packed, reference.unpack_int8(packed, rows),
                                 dtype, generator)


def _assert_kernel_matches_dense(kernel, packed, dense, dtype, generator):
    """kernel(x, packed, bias, N) against F.linear of the same float weights, 1..17 rows of x,
    with and without bias: within bf16 output rounding, or accumulation order in float32."""
    rows, cols = dense.shape
    bias = torch.randn(rows, generator=generator).to(dtype)
    tolerance = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    for m in [*range(1, 18), 25]:
        x = torch.randn(m, cols, generator=generator).to(dtype)
        for b in (None, bias):
            expected = nn.functional.linear(x.float(), dense, None if b is None else b.float())
            got = kernel(x, packed, b, rows)
            assert got.dtype == dtype and got.shape == (m, rows)
            torch.testing.assert_close(got.float(), expected, rtol=tolerance,
                                       atol=tolerance * expected.abs().max().item())


def test_bf16_pack_round_trips():
    weight = torch.randn(37, 96)
    packed = reference.pack_bf16(weight)
    assert packed.shape == (3, 3, 1024)
    assert torch.equal(reference.unpack_bf16(packed, 37), weight.to(torch.bfloat16).float())


@pytest.mark.parametrize("shape", [(37, 64), (130, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_kernel_matches_the_dense_linear(shape, dtype, kernels):
    """Same bf16 weights as F.linear of their float values: only accumulation order differs."""
    rows, cols = shape
    generator = torch.Generator().manual_seed(cols + 1)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    packed = reference.pack_bf16(weight)
    _assert_kernel_matches_dense(kernels.bf16_linear, packed, reference.unpack_bf16(packed, rows),
                                 dtype, generator)


def test_unquantized_bf16_model_decodes_through_the_bf16_kernel_losslessly():
    """bf16 + no quantization: projections and LM head on our bf16 panel kernel for decode
    batches, the dense GEMM above its limit; the same bf16 weights, so one row alone and the
    same row among 19 others agree within bf16 accumulation noise, and the eager reference
    (no kernel) agrees too."""
    from kvserve.quant.linear import Bf16PanelLinear

    model = random_model(tiny_config(), "bfloat16", seed=3, attention_backend="paged")
    if not model.kernel_ops.int4_linear_fast():
        pytest.skip("no vectorised kernel build")
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.impl, Bf16PanelLinear)
    assert isinstance(model.lm_head.impl, Bf16PanelLinear)
    prompt = [(5 * i + 1) % 200 + 3 for i in range(12)]
    alone = PagedLoop(model, 1, 32).step([prompt], [12], [0])[0]
    others = [[(t + k) % 200 + 3 for t in prompt] for k in range(1, 20)]
    batched = PagedLoop(model, 20, 32).step([prompt] + others, [12] * 20, list(range(20)))[0]
    assert (alone - batched).abs().max() <= 0.03 * max(1.0, alone.abs().max().item())
    eager = random_model(tiny_config(), "bfloat16", seed=3, attention_backend="torch_ref")
    reference_logits = PagedLoop(eager, 1, 32).step([prompt], [12], [0])[0]
    assert (alone - reference_logits).abs().max() <= 0.05 * max(1.0, alone.abs().max().item())
