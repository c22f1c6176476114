"""Integer-dot kernels (w4a8): activations rounded to int8 per group of 32, int4 or Q8_0 weights.
Each kernel at every ISA level equals the float linear of the *rounded* activations (the integer
dot products are exact), the rounding is llama.cpp's Q8, and a w4a8 model decodes alone as in a
batch. The perplexity bound is in test_quant.py's slow test."""

import pytest
import torch
from torch import nn

from kvserve.kernels import reference
from kvserve.models import random_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.quant.linear import W4A8Linear, quantize_int4_groupwise
from kvserve.testing.tiny import tiny_config
from tests.helpers import assert_equals_linear_of_rounded_x


def test_activation_rounding_is_per_group_absmax_over_127():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=generator) * torch.tensor([1.0, 10.0, 0.01])[:, None]
    x[1, 32:64] = 0  # an all-zero group stays zero (no division by a zero step)
    rounded = reference.quantize_activations_q8(x)
    groups, got = x.view(3, 3, 32), rounded.view(3, 3, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(got[1, 1], torch.zeros(32))
    # every value is an integer number of steps, at most half a step from x, within +-127 steps
    codes = torch.where(step > 0, got / torch.where(step > 0, step, 1), 0)
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert (codes.abs() <= 127 + 1e-3).all()
    assert ((got - groups).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()


def _rounding_cases(rows: int, cols: int) -> torch.Tensor:
    """Random groups at several scales, an all-zero group, and groups of absmax 127 (step 1)
    holding exact ties (+-2.5, 3.5, ...), which round half to even."""
    generator = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.logspace(-3, 3, rows)[:, None]
    x[0, :32] = 0
    ties = torch.arange(32) - 15.5  # -15.5 .. 15.5: every value a tie
    x[:, 32:64] = ties
    x[:, 32] = 127.0  # the group's absmax: step 1, so the ties stay ties
    return x


@pytest.mark.parametrize("cols", [64, 576, 1536])
def test_activation_codes_equal_the_reference_rounding_to_the_bit(cols, kernels):
    """Identity weights (codes 0/1, scale 1, low 0) make each output x' = step * code itself:
    the kernels' rounding of x (vectorised per group on AVX2/AVX-512) equals the reference's,
    ties to even included, in both code orders (int4 lanes, Q8_0's natural order)."""
    rows = 5
    x = _rounding_cases(rows, cols)
    expected = reference.quantize_activations_q8(x)
    assert torch.equal(expected[:, 33:35], torch.tensor([[-14.0, -14.0]] * rows))  # -14.5, -13.5
    identity = torch.eye(cols)
    ones, zeros = torch.ones(cols, cols // 32), torch.zeros(cols, cols // 32)
    int4 = reference.pack_int4(identity.int(), ones, zeros, torch.float16)
    int8 = reference.pack_int8(identity.to(torch.int8), ones)
    assert torch.equal(kernels.int4_linear_q8(x, int4, None, cols), expected)
    assert torch.equal(kernels.int8_linear_q8(x, int8, None, cols), expected)


def _int4_packed(rows, cols, meta_dtype, seed):
    """The integer-dot kernel's panels: codes with (scale, low) per group in meta_dtype."""
    generator = torch.Generator().manual_seed(seed)
    codes, scale, low = quantize_int4_groupwise(torch.randn(rows, cols, generator=generator))
    return reference.pack_int4(codes, scale, low, meta_dtype)


def _int8_packed(rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    return reference.pack_int8(*reference.quantize_int8_groupwise(weight))


@pytest.mark.parametrize("shape", [(37, 64), (96, 1536), (130, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_q8_kernel_is_the_linear_of_rounded_activations(shape, dtype, kernels):
    rows, cols = shape
    for meta_dtype in (torch.float16, torch.float32):
        packed = _int4_packed(rows, cols, meta_dtype, seed=cols)
        dense = reference.unpack_int4_q8(packed, rows)
        assert_equals_linear_of_rounded_x(kernels.int4_linear_q8, packed, dense, dtype)
        assert_equals_linear_of_rounded_x(reference.int4_linear_q8, packed, dense, dtype)


@pytest.mark.parametrize("shape", [(37, 64), (130, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_q8_kernel_is_the_linear_of_rounded_activations(shape, dtype, kernels):
    rows, cols = shape
    packed = _int8_packed(rows, cols, seed=cols)
    dense = reference.unpack_int8(packed, rows)
    assert_equals_linear_of_rounded_x(kernels.int8_linear_q8, packed, dense, dtype)
    assert_equals_linear_of_rounded_x(reference.int8_linear_q8, packed, dense, dtype)


def test_extreme_activations_do_not_saturate(kernels):
    """Every code at 15 against x at +-absmax: the int16 partial sums reach 8 * 2 * 15 * 127 =
    30,480, just under int16's limit; a saturating sum would be visibly wrong."""
    rows, cols = 16, 64
    codes = torch.full((rows, cols), 15, dtype=torch.int32)
    scale, low = torch.ones(rows, 2), torch.zeros(rows, 2)
    packed = reference.pack_int4(codes, scale, low, torch.float32)
    dense = reference.unpack_int4_q8(packed, rows)
    for sign in (1.0, -1.0):
        x = torch.full((1, cols), sign * 3.0)
        expected = nn.functional.linear(x, dense)
        torch.testing.assert_close(kernels.int4_linear_q8(x, packed, None, rows), expected)


def test_only_vnni_builds_report_wide_integer_dots(kernels):
    """`q8_dot_wide` (what makes `--quantization auto` pick w4a8 in bfloat16) is the build's own
    answer: the avx512_vnni and avx512_bf16 levels are compiled with AVX512-VNNI, the others
    are not."""
    assert kernels.q8_dot_wide() == (kernels.isa in ("avx512_vnni", "avx512_bf16"))
    assert reference.q8_dot_wide() is False


def test_w4a8_layer_keeps_float16_metadata_only_when_exact(kernels):
    """Scales and lows already in float16 (a GGUF's Q4_1) are stored in float16, losslessly;
    others stay float32. Decode rows go through the integer kernel either way."""
    if not kernels.int4_linear_fast():
        pytest.skip(f"the {kernels.isa} build has no vectorised int4 kernel")
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (96, 128), generator=generator).float()
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # each group spans its min and max, as Q4_1's do
    # float16 scales and lows on a coarse binary grid: every product and sum exact in float32
    scale = torch.randint(1, 1024, (96, 4), generator=generator).float() / 2 ** 16
    low = -torch.randint(0, 2048, (96, 4), generator=generator).float() / 2 ** 12
    q4_1 = (codes.view(96, 4, 32) * scale[..., None] + low[..., None]).view(96, 128)
    linear = nn.Linear(128, 96)
    for weight, block_bytes in ((q4_1, 320), (torch.randn(96, 128) * 0.05, 384)):
        linear.weight.data = weight
        layer = W4A8Linear(linear, torch.float32, kernels)
        assert layer.kernel is kernels.int4_linear_q8 and layer.panels.shape[2] == block_bytes
        if block_bytes == 320:  # float16 metadata holds the Q4_1 weights exactly
            assert torch.equal(layer.dense_weight, weight)
        _assert_layer_is_linear_of_rounded_x(layer)


def _assert_layer_is_linear_of_rounded_x(layer):
    x = torch.randn(3, 128)
    expected = nn.functional.linear(reference.quantize_activations_q8(x), layer.dense_weight,
                                    layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_w4a8_model_one_row_equals_batched():
    """Decoded alone (integer-dot GEMVs and LM head) and among 19 others (the dense GEMM of the
    same int4 weights, float activations): the logits differ only by the activations' rounding."""
    model = random_model(tiny_config(), "float32", seed=3, attention_backend="paged",
                         quantization="w4a8")
    assert model.quantization == "w4a8"
    prompt = [(5 * i + 1) % 200 + 3 for i in range(12)]
    alone = PagedLoop(model, 1, 32).step([prompt], [12], [0])[0]
    others = [[(t + k) % 200 + 3 for t in prompt] for k in range(1, 20)]
    batched = PagedLoop(model, 20, 32).step([prompt] + others, [12] * 20, list(range(20)))[0]
    assert (alone - batched).abs().max() <= 0.03 * max(1.0, alone.abs().max().item())
