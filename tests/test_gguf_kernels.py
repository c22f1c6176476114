"""GGUF's block formats kept as the file stores them (csrc/gguf_layouts.h): packing gives the
reference layout byte for byte, dequantizing gives gguf.quants.dequantize's float32 values to the
bit, the integer-dot kernel is the float linear of the rounded activations and the file's
weights, the dequantizing one the float linear of x and those weights. At every kernel level,
and for the torch reference ops."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from kvserve.kernels import reference
from tests.helpers import assert_equals_linear_of_rounded_x

QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
# byte offsets of each K-quant block's float16 scales (d, and dmin for Q4_K/Q5_K)
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _file_rows(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A GGUF tensor's bytes [rows, row_bytes]: gguf.quants.quantize of random weights where the
    package implements the type, else random blocks with finite float16 scales of either sign."""
    generator = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in _SCALE_OFFSETS:
        weight = generator.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(weight, kind)))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = generator.integers(0, 256, (rows, cols // block_values, block_bytes), np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        scale = (generator.standard_normal((rows, cols // block_values)) * 1e-2).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def _file_values(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values))


def _assert_bits_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    mismatched = (got.view(bits) != expected.view(bits)).sum().item()
    assert mismatched == 0, f"{mismatched} values differ"


@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_then_dequantize_gives_the_files_values_to_the_bit(qtype, kernels):
    """37 rows (a partial last panel), 2 super-blocks of 256 (16 groups of 32): the packed bytes
    are the reference packer's (rows past N zero), and every row, a list of rows (repeats, any
    order) and a range read back as gguf's float32 values exactly, or those values rounded to
    bfloat16."""
    rows, cols = 37, 512
    raw = _file_rows(qtype, rows, cols, seed=len(qtype) + rows)
    expected = _file_values(raw, qtype)
    panels = kernels.gguf_pack(raw, qtype)
    assert torch.equal(panels, reference.gguf_pack(raw, qtype))
    assert panels.shape[2] == reference.GGUF_FORMATS[qtype][2]
    picked = torch.tensor([36, 0, 17, 17, 5])
    for ops in (kernels, reference):
        _assert_bits_equal(ops.gguf_dequantize(panels, qtype, range(rows), cols, torch.float32),
                           expected)
        _assert_bits_equal(ops.gguf_dequantize(panels, qtype, picked, cols, torch.float32),
                           expected[picked])
        _assert_bits_equal(ops.gguf_dequantize(panels, qtype, range(16, 33), cols,
                                               torch.bfloat16), expected[16:33].bfloat16())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("ops_name", ["kernels", "reference"])
def test_parts_packed_into_one_tensors_panels_equal_the_joined_parts(qtype, ops_name, kernels):
    """A projection's parts (Q, K, V) packed each into its run of the panels (`out`) are the
    panels of their rows joined; a part of whole panels is required before the last, and the
    wrong `out` shape is a clear error."""
    from kvserve.quant.stored import pack_segments
    from kvserve.weights.quantized_rows import QuantizedRows

    ops = kernels if ops_name == "kernels" else reference
    block = reference.GGUF_FORMATS[qtype][0]
    raws = [_file_rows(qtype, rows, 512, seed=rows) for rows in (32, 16, 21)]
    parts = [QuantizedRows(qtype, raw, 512, block, f"part{i}") for i, raw in enumerate(raws)]
    joined = ops.gguf_pack(torch.cat(raws), qtype)
    (segment,) = pack_segments(parts, ops)
    assert torch.equal(segment.panels, joined) and segment.rows == 69
    uneven = [QuantizedRows(qtype, raw, 512, block) for raw in (raws[2], raws[0])]
    (segment,) = pack_segments(uneven, ops)  # 21 rows first: joined, then packed
    assert torch.equal(segment.panels, ops.gguf_pack(torch.cat([raws[2], raws[0]]), qtype))
    with pytest.raises(ValueError, match="out must be contiguous uint8"):
        ops.gguf_pack(raws[0], qtype, torch.empty_like(joined))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_kernel_is_the_linear_of_rounded_activations(qtype, dtype, kernels):
    """37 outputs of K = 512, x rounded as int4_linear_q8 rounds it: the float linear of x' and
    the file's weights (assert_equals_linear_of_rounded_x's row counts, bias, strides)."""
    raw = _file_rows(qtype, 37, 512, seed=3 * len(qtype))
    panels, dense = reference.gguf_pack(raw, qtype), _file_values(raw, qtype)
    for ops in (kernels, reference):
        def kernel(x, packed, bias, rows, ops=ops):
            return ops.gguf_linear_q8(x, packed, qtype, bias, rows)
        assert_equals_linear_of_rounded_x(kernel, panels, dense, dtype)


@pytest.mark.parametrize("qtype", reference.SUPERBLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_superblock_kernel_is_the_linear_of_activations_rounded_per_superblock(qtype, dtype,
                                                                               kernels):
    """gguf_linear_q8k: x rounded at one step per super-block of 256 (Q8_K), the sub-blocks'
    integer scales applied in int32: the float linear of that x' and the file's weights (37
    outputs, 2 super-blocks along K)."""
    raw = _file_rows(qtype, 37, 512, seed=5 * len(qtype))
    panels, dense = reference.gguf_pack(raw, qtype), _file_values(raw, qtype)
    for ops in (kernels, reference):
        def kernel(x, packed, bias, rows, ops=ops):
            return ops.gguf_linear_q8k(x, packed, qtype, bias, rows)
        assert_equals_linear_of_rounded_x(kernel, panels, dense, dtype,
                                          reference.quantize_activations_q8k)


@pytest.mark.parametrize("ops_name", ["kernels", "reference"])
def test_engine_path_takes_superblocks_for_k_quant_calls_of_a_pass_or_more(ops_name, kernels):
    """gguf_linear_int (what StoredLinear and the decode stack call): gguf_linear_q8k from
    SUPERBLOCK_MIN_ROWS rows for the K-quants, gguf_linear_q8 below it, for the other types,
    and everywhere while switched off (KVSERVE_GGUF_SUPERBLOCKS=0)."""
    ops = kernels if ops_name == "kernels" else reference
    few, many = reference.SUPERBLOCK_MIN_ROWS - 1, reference.SUPERBLOCK_MIN_ROWS
    for qtype in ("Q4_K", "Q6_K", "Q8_0"):
        panels = reference.gguf_pack(_file_rows(qtype, 32, 512, seed=7), qtype)
        for rows in (few, many):
            x = torch.randn(rows, 512) * torch.linspace(0.01, 4, 512)  # steps differ by span
            wide = rows == many and qtype in reference.SUPERBLOCK_TYPES
            expected = (ops.gguf_linear_q8k if wide else ops.gguf_linear_q8)(
                x, panels, qtype, None, 32)
            assert torch.equal(ops.gguf_linear_int(x, panels, qtype, None, 32), expected)
            assert wide == (not torch.equal(expected, ops.gguf_linear_q8(x, panels, qtype, None,
                                                                         32)))
            ops.set_gguf_superblocks(False)
            try:
                assert not ops.gguf_superblocks_enabled()
                assert torch.equal(ops.gguf_linear_int(x, panels, qtype, None, 32),
                                   ops.gguf_linear_q8(x, panels, qtype, None, 32))
            finally:
                ops.set_gguf_superblocks(True)


@pytest.mark.parametrize("ops_name", ["kernels", "reference"])
def test_superblock_kernel_refuses_formats_without_superblocks(ops_name, kernels):
    ops = kernels if ops_name == "kernels" else reference
    raw = _file_rows("Q8_0", 16, 256, seed=0)
    with pytest.raises(ValueError, match="Q8_0 has no super-blocks"):
        ops.gguf_linear_q8k(torch.ones(1, 256), reference.gguf_pack(raw, "Q8_0"), "Q8_0", None,
                            16)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_largest_codes_do_not_saturate(qtype, kernels):
    """Every code at its maximum (31, or 63 for Q6_K) against x at +-absmax: vpmaddubsw's int16
    pair sums reach 2 * 63 * 127 = 16,002; a saturating or overflowing sum would be visibly
    wrong."""
    rows, cols = 16, 256
    raw = _file_rows(qtype, rows, cols, seed=1)
    blocks = raw.view(rows, cols // reference.GGUF_FORMATS[qtype][0], -1)
    scales = {"Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[qtype]
    code_bytes = {"Q5_0": slice(2, 22), "Q5_1": slice(4, 24), "Q5_K": slice(16, 176),
                  "Q6_K": slice(0, 192)}[qtype]
    blocks[..., code_bytes] = 0xFF
    if qtype == "Q6_K":
        blocks[..., 192:208] = 127
    for offset in scales:
        blocks[..., offset:offset + 2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    panels, dense = kernels.gguf_pack(raw, qtype), _file_values(raw, qtype)
    for sign in (1.0, -1.0):
        x = torch.full((2, cols), sign * 3.0)
        torch.testing.assert_close(kernels.gguf_linear_q8(x, panels, qtype, None, rows),
                                   nn.functional.linear(x, dense))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_kernel_is_the_linear_of_the_files_weights(qtype, dtype, kernels):
    """600 outputs of K = 256 (two slabs of rows, the second partial), with and without bias:
    at::linear of x and the exact weights in x's dtype."""
    rows, cols = 600, 256
    raw = _file_rows(qtype, rows, cols, seed=5 * len(qtype))
    panels, dense = reference.gguf_pack(raw, qtype), _file_values(raw, qtype).to(dtype)
    generator = torch.Generator().manual_seed(cols)
    bias = torch.randn(rows, generator=generator)
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    for m in (1, 7, 33):
        x = torch.randn(m, cols, generator=generator).to(dtype)
        for b in (None, bias):
            expected = nn.functional.linear(x.float(), dense.float(),
                                            None if b is None else b.to(dtype).float())
            for ops in (kernels, reference):
                got = ops.gguf_linear_dequant(x, panels, qtype, b, rows)
                assert got.dtype == dtype and got.shape == (m, rows)
                torch.testing.assert_close(got.float(), expected, rtol=tolerance,
                                           atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_kernel_multiplies_the_files_exact_values(qtype, dtype, kernels):
    """x = the identity picks out W.T itself (each output one product by 1 plus exact zeros):
    the weights the GEMM was given are gguf's float32 values exactly (rounded to bfloat16 in
    bfloat16), over two slabs of rows whose last panel is partial."""
    rows, cols = 600, 256
    raw = _file_rows(qtype, rows, cols, seed=3 * len(qtype))
    panels, expected = kernels.gguf_pack(raw, qtype), _file_values(raw, qtype).to(dtype)
    got = kernels.gguf_linear_dequant(torch.eye(cols, dtype=dtype), panels, qtype, None, rows)
    assert torch.equal(got, expected.t())  # == : a weight's -0.0 comes out as 0.0 + -0.0


@pytest.fixture
def amx_switch(kernels):
    """Sets the AMX switch of gguf_linear_dequant for a test and restores it (on) after."""
    yield kernels.set_gguf_amx
    kernels.set_gguf_amx(True)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_amx_tiles_give_the_dequantizing_linear_of_the_same_weights(qtype, kernels, amx_switch):
    """bfloat16 x through the AMX tiles against the same call with them switched off (oneDNN on
    the same bfloat16 weights): 584 outputs (an odd panel count, the last panel partial), row
    counts that leave partial tiles and odd row blocks, with and without bias; and x = the
    identity reads back W.T's bfloat16 values to the bit."""
    if not kernels.gguf_amx_usable():
        pytest.skip("no AMX-BF16 tiles on this CPU or build")
    rows, cols = 584, 512
    raw = _file_rows(qtype, rows, cols, seed=11 * len(qtype))
    panels = kernels.gguf_pack(raw, qtype)
    weights = _file_values(raw, qtype).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(rows, generator=generator)
    for m in (1, 15, 16, 17, 48, 70):
        x = torch.randn(m, cols, generator=generator).to(torch.bfloat16)
        for b in (None, bias):
            amx_switch(True)
            got = kernels.gguf_linear_dequant(x, panels, qtype, b, rows)
            amx_switch(False)
            expected = kernels.gguf_linear_dequant(x, panels, qtype, b, rows)
            assert got.dtype == torch.bfloat16 and got.shape == (m, rows)
            scale = expected.float().abs().max().item()
            torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7,
                                       atol=2 ** -7 * scale)
    amx_switch(True)
    eye = torch.eye(cols, dtype=torch.bfloat16)
    assert torch.equal(kernels.gguf_linear_amx(eye, panels, qtype, None, rows), weights.t())


def test_amx_tiles_refuse_what_they_do_not_take(kernels, amx_switch):
    """float32 x and formats without a tile path are named in the error; switched off, the
    dequantizing linear does not use the tiles."""
    if not kernels.gguf_amx_usable():
        pytest.skip("no AMX-BF16 tiles on this CPU or build")
    raw = _file_rows("Q4_K", 16, 256, seed=0)
    panels = kernels.gguf_pack(raw, "Q4_K")
    with pytest.raises(RuntimeError, match="not available for Q4_K with Float"):
        kernels.gguf_linear_amx(torch.randn(4, 256), panels, "Q4_K", None, 16)
    q8_panels = kernels.gguf_pack(_file_rows("Q8_0", 16, 256, seed=0), "Q8_0")
    with pytest.raises(RuntimeError, match="not available for Q8_0"):
        kernels.gguf_linear_amx(torch.randn(4, 256).bfloat16(), q8_panels, "Q8_0", None, 16)
    amx_switch(False)
    assert not kernels.gguf_amx_usable()


@pytest.mark.parametrize("ops_name", ["kernels", "reference"])
def test_malformed_inputs_are_clear_errors(ops_name, kernels):
    """A raw tensor whose rows are not whole blocks, panels of another K, an unknown type, and a
    Q4_0 scale whose -8d overflows float16: errors naming the type and the sizes."""
    ops = kernels if ops_name == "kernels" else reference
    raw = _file_rows("Q4_K", 4, 256, seed=0)
    with pytest.raises(ValueError, match=r"Q4_K rows of 143 bytes .*144 bytes per 256 values"):
        ops.gguf_pack(raw[:, :143].contiguous(), "Q4_K")
    panels = ops.gguf_pack(raw, "Q4_K")
    with pytest.raises(ValueError, match="Q4_K panels"):
        ops.gguf_dequantize(panels, "Q4_K", range(4), 512, torch.float32)
    with pytest.raises(ValueError, match="IQ2_XS has no panel layout"):
        ops.gguf_pack(raw, "IQ2_XS")
    huge = _file_rows("Q4_0", 1, 32, seed=0)
    huge[0, :2] = torch.tensor([9000.0], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(ValueError, match="Q4_0 block's scale d exceeds 8188"):
        ops.gguf_pack(huge, "Q4_0")
