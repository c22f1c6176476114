"""Quantized replacements for the decoder's nn.Linear projections.

Each layer keeps its low-bit weights for the cases the low-bit kernels win and a dense copy of the
*dequantized* weights for the rest, so the model's weights are the same values whichever kernel
runs; only the accumulation order differs. Where our kernels (kvserve/kernels/csrc/int4_gemm.cpp,
int8_gemm.cpp, bf16_gemm.cpp) stop beating the dense GEMM depends on the CPU and is measured at
start-up (kvserve/kernels/autotune.py): on a Zen 4 the bf16 int4 kernel wins up to 128 rows and
beyond, the AVX2 float32 one up to 16-32. Without our kernels: torch's int4/int8 weight-only kernels
beat a bf16 GEMM for 1-4 rows on AVX-512 (and lose to fp32 at every size on AVX2);
`torch._int_mm` (VNNI) is ~2x faster than bf16 from ~16 rows on (Zen 5, FACTS.md).

- `int4`: groupwise (32) asymmetric 4-bit, as GGUF's Q4_1: w = (q - 8) * scale + zero. Re-quantizing
  a Q4_1 GGUF's dequantized weights this way recovers its codes exactly (each Q4_1 block holds its
  min at code 0 and its max at code 15); scales are then rounded to the activation dtype.
- `int8`: groupwise (32) symmetric 8-bit weights, GGUF's Q8_0 (exact for a Q8_0 checkpoint), with
  float activations, through our kernel for decode batches (kernels/csrc/int8_gemm.cpp; the
  dense copy beyond). Without our vector kernels: per-output-channel weight-only on torch's
  int8 kernel (measured ~1.2 GB/s of weights at one row on AVX2 against our kernel's ~11).
- every quantized mode: the LM head in int8, groupwise (GGUF Q8_0-exact) with our kernel.
- unquantized bf16: projections and LM head laid out for our bf16 decode kernel (lossless).
- `w4a8`: the `int4` weights (same panels), with each decode row's activations rounded to int8
  per group of 32 (llama.cpp's Q8 activations) so the GEMVs and the LM head run on integer
  multiply-adds (kernels/csrc/q8_dot_gemm.cpp): ~2x faster at 1-32 rows on AVX2, lossy in the
  activations only (perplexity in docs/performance-journal.md). Prefill takes it too where
  the autotuner measures it faster than the dense GEMM (float32 on AVX2).
- `w8a8`: the `int8` weights, and batched rows quantized per token to int8 on the fly so the GEMM
  runs on int8 units (`torch._int_mm`); small batches use the weight-only kernel.

Tensor parallelism: each rank quantizes its own float32 slice. Column-parallel slices (rows) and
row-parallel ones (columns of o_proj/down_proj, cut at int4 group boundaries) get the codes and
scales the whole matrix would; the per-channel int8 scales of row-parallel slices come from the
whole row's absmax (one max all-reduce at load). Only w8a8's per-token activation scales differ
from one rank: each rank sees its slice of the activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import autotune
from kvserve.quant.modes import FLOAT_SOURCE_TYPES, check_quantization_device, device_type
from kvserve.kernels.reference import (
    pack_bf16,
    pack_int4,
    pack_int8,
    quantize_int8_groupwise,
)

INT4_GROUP_SIZE = 32
# Row counts at which the low-bit kernels stop winning. Our kernels' limits are measured per
# shape on the machine at start-up (kvserve/kernels/autotune.py); these fixed values apply with
# autotuning off and were chosen to be safe on every CPU measured (SmolLM2 shapes: the AVX2
# float32 int4 kernel beats the dense GEMM up to 16 rows, the AVX512-BF16 one up to 128+; the
# int8 LM head kernel beats the dense copy up to 16 rows in bf16 and 128+ in float32).
WEIGHT_ONLY_MAX_ROWS = 4  # torch's int4/int8 weight-only kernels (no kvserve kernels built)
INT4_KERNEL_MAX_ROWS = 16
INT_MM_MIN_ROWS = 16
# The LM head's shape [49152, 576]: torch's int8 kernel beats the bf16 copy up to 8 rows (1.85 vs
# 2.34 ms at 8, 3.7 vs 2.9 ms at 16, measured on Zen 5)
LM_HEAD_WEIGHT_ONLY_MAX_ROWS = 8
LM_HEAD_INT8_KERNEL_MAX_ROWS = 16
BF16_KERNEL_MAX_ROWS = 16  # our bf16 panel kernel vs oneDNN's bf16 GEMM, with autotuning off
# Resolved once: looking an op up through torch.ops on every call costs microseconds per GEMV.
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT_MM = torch.ops.aten._int_mm.default


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE):
    """float [N, K] -> codes int32 [N, K] in 0..15, scale and min float32 [N, K / group]."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - low[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.int32)
    return codes.view(rows, cols), scale, low


def quantize_int8_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None):
    """float [N, K] -> int8 [N, K] and float32 scales [N] (symmetric, absmax / 127). `absmax`:
    each row's absolute maximum when `weight` is a slice of longer rows (tensor parallelism)."""
    scale = (weight.float().abs().amax(1) if absmax is None else absmax) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (weight.float() / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


class Int4WeightOnlyLinear(nn.Module):
    """With compiled ops (`ops.int4_linear_fast()`): our int4 kernel (kernels/csrc/int4_gemm.cpp)
    up to the row count the autotuner measured for this shape (INT4_KERNEL_MAX_ROWS with it off),
    on weights in its panel layout. Otherwise (torch
    reference ops, no ops, float16): torch's int4 kernel for up to WEIGHT_ONLY_MAX_ROWS rows.
    Larger batches (prefill) take the dense copy either way."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, ops=None):
        super().__init__()
        rows, cols = linear.weight.shape
        if cols % INT4_GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP_SIZE}, got {cols}")
        codes, scale, low = quantize_int4_groupwise(linear.weight.data)
        scale_t, zero_t = scale.to(dtype).float(), (low + 8 * scale).to(dtype).float()
        # the kernels compute (q - 8) * scale + zero with scale, zero in the activation dtype
        dequantized = (codes.view(rows, -1, INT4_GROUP_SIZE) - 8) * scale_t[..., None] \
            + zero_t[..., None]
        self.register_buffer("dense_weight", dequantized.view(rows, cols).to(dtype))
        self.register_buffer("bias", _bias(linear, dtype))
        self.out_features = rows
        self.ops = ops if _has_int4_kernel(ops, dtype) else None
        if self.ops is not None:
            # scales and zeros as exact as the activation dtype, in half the bytes for bf16
            meta_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
            self.register_buffer("panels", pack_int4(codes, scale_t, zero_t, meta_dtype))
            self.max_rows = autotune.max_rows("int4", ops.int4_linear, self.panels,
                                              self.dense_weight, dtype, ops.isa,
                                              INT4_KERNEL_MAX_ROWS, owner=self)
        else:
            self.max_rows = WEIGHT_ONLY_MAX_ROWS
            self.register_buffer("packed",
                                 torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))
            self.register_buffer("scales_and_zeros", torch.stack([scale_t, zero_t], -1)
                                 .transpose(0, 1).contiguous().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.dense_weight, self.bias)
        if self.ops is not None:
            return self.ops.int4_linear(x, self.panels, self.bias, self.out_features)
        out = _INT4_MM(x, self.packed, INT4_GROUP_SIZE, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias


def _has_vector_kernels(ops) -> bool:
    """Our low-bit kernels, compiled for a vector level (AVX2 or AVX-512); the torch reference
    versions dequantize the whole matrix per call and the scalar build is slower than torch."""
    return ops is not None and ops.int4_linear_fast()


def _has_int4_kernel(ops, dtype: torch.dtype) -> bool:
    return _has_vector_kernels(ops) and dtype in (torch.bfloat16, torch.float32)


class Int8WeightOnlyLinear(nn.Module):
    keeps_dense_copy = True  # for batches over max_rows rows

    def __init__(self, linear: nn.Linear, dtype: torch.dtype,
                 max_rows: int = WEIGHT_ONLY_MAX_ROWS, absmax: torch.Tensor | None = None):
        super().__init__()
        self.max_rows = max_rows
        codes, scale = quantize_int8_per_channel(linear.weight.data, absmax)
        scale_t = scale.to(dtype)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scale_t)
        self.register_buffer("weight_scale", scale)  # float32, for the W8A8 epilogue
        if self.keeps_dense_copy:
            self.register_buffer("dense_weight",
                                 (codes.float() * scale_t.float()[:, None]).to(dtype))
        self.register_buffer("bias", _bias(linear, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.dense_weight, self.bias)
        return self._weight_only(x)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        out = _INT8_MM(x, self.codes, self.scales)
        return out if self.bias is None else out + self.bias


class W8A8Linear(Int8WeightOnlyLinear):
    """int8 x int8 -> int32 GEMMs for batches of INT_MM_MIN_ROWS rows or more."""

    keeps_dense_copy = False  # large batches take the int8 GEMM

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, ops,
                 absmax: torch.Tensor | None = None):
        super().__init__(linear, dtype, absmax=absmax)
        self.ops = ops
        self.codes_t = self.codes.t()  # [K, N] view for torch._int_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < INT_MM_MIN_ROWS:
            return self._weight_only(x)
        codes, token_scale = self.ops.quantize_per_token(x)
        accumulated = _INT_MM(codes, self.codes_t)
        return self.ops.dequantize_int32(accumulated, token_scale, self.weight_scale, self.bias,
                                         x.dtype)


class _PanelLinear(nn.Module):
    """Weights in one of our kernels' panel layouts plus a dense copy of the same values: the
    kernel serves batches up to the row count the autotuner measured for this shape (`fallback`
    with it off), the dense GEMM larger ones."""

    def __init__(self, kind: str, kernel, panels: torch.Tensor, dense: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, isa: str, fallback: int,
                 prefill: bool = False):
        super().__init__()
        self.register_buffer("panels", panels)
        self.register_buffer("dense_weight", dense.to(dtype))
        self.register_buffer("bias", bias)
        self.out_features = dense.shape[0]
        self.kernel = kernel
        self.max_rows = autotune.max_rows(kind, kernel, panels, self.dense_weight, dtype, isa,
                                          fallback, prefill, owner=self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.dense_weight, self.bias)
        return self.kernel(x, self.panels, self.bias, self.out_features)


class Int8GroupwiseLinear(_PanelLinear):
    """int8 per group of 32 along K with a float32 scale: GGUF's Q8_0 exactly (SmolLM2's tied
    embedding is Q8_0, so the LM head computes with the checkpoint's own weights), through our
    kernel (kernels/csrc/int8_gemm.cpp, float FMAs on the widened codes) for decode batches."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, ops, max_rows: int,
                 int8_activations: bool = False):
        """`int8_activations` (w4a8): x rounded to int8 per group, integer dot products."""
        codes, scale = quantize_int8_groupwise(linear.weight.data)
        dense = (codes.float().view(codes.shape[0], -1, 32) * scale[..., None]).view(codes.shape)
        kind, kernel = (("int8_q8", ops.int8_linear_q8) if int8_activations
                        else ("int8", ops.int8_linear))
        super().__init__(kind, kernel, pack_int8(codes, scale), dense,
                         _bias(linear, dtype), dtype, ops.isa, max_rows)


class W4A8Linear(_PanelLinear):
    """w4a8: int4 codes with a scale and a low per group (w = q * scale + low), and decode rows of
    x rounded to int8 per group of 32 so our kernel (kernels/csrc/q8_dot_gemm.cpp) multiplies with
    integer dot products. Scales and lows are stored in float16 when that holds every one exactly
    (GGUF's Q4_0/Q4_1 store them in float16): a sixth fewer bytes per step than float32, no loss.
    Where the autotuner finds the integer kernel faster at prefill sizes too (on AVX2, where the
    dense GEMM is float32), prefill takes it; otherwise the dense copy of the same weights."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, ops):
        rows, cols = linear.weight.shape
        if cols % INT4_GROUP_SIZE:
            raise ValueError(f"w4a8 needs in_features divisible by {INT4_GROUP_SIZE}, got {cols}")
        codes, scale, low = quantize_int4_groupwise(linear.weight.data)
        meta_dtype = torch.float16 if _fits_float16(scale) and _fits_float16(low) \
            else torch.float32
        scale, low = scale.to(meta_dtype).float(), low.to(meta_dtype).float()
        dense = (codes.view(rows, -1, INT4_GROUP_SIZE) * scale[..., None]
                 + low[..., None]).view(rows, cols)
        super().__init__("int4_q8", ops.int4_linear_q8, pack_int4(codes, scale, low, meta_dtype),
                         dense, _bias(linear, dtype), dtype, ops.isa, INT4_KERNEL_MAX_ROWS,
                         prefill=True)


def _fits_float16(values: torch.Tensor) -> bool:
    return bool((values.to(torch.float16).float() == values).all())


class Bf16PanelLinear(_PanelLinear):
    """Unquantized bf16 weights through our kernel (kernels/csrc/bf16_gemm.cpp: oneDNN's bf16
    GEMM read weights at ~7 GB/s at one row on Zen 4) for decode batches: the same bf16 values
    as the dense copy, so the lossless mode stays lossless."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, ops):
        super().__init__("bf16", ops.bf16_linear, pack_bf16(linear.weight.data),
                         linear.weight.data, _bias(linear, dtype), dtype, ops.isa,
                         BF16_KERNEL_MAX_ROWS)


def _bias(linear: nn.Linear, dtype: torch.dtype) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.data.to(dtype)


def resolve_quantization(mode: str, source_weight_type: str | None, dtype: torch.dtype,
                         dtype_is_default: bool = False, device: str = "cpu") -> str:
    """`auto`, for a GGUF whose layers are block-quantized, on a CPU with our vector kernels
    (`dtype_is_default` is only true there, see load_model), in bfloat16 or in a float32 the
    machine chose: `gguf`, the file's own numbers at its own bits per weight where our kernels
    keep its block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; others converted to
    w4a8), activations rounded to int8 per group of 32 in decode-sized batches as llama.cpp
    does; for a block-scaled fp8 checkpoint likewise `fp8` (quant/fp8.py). A float32 the user
    asked for stays the exact reference: no quantization; so does a
    checkpoint of float weights. Off the CPU (`device` cuda, ...) the 4-bit and stored modes do
    not run: `auto` keeps the dequantized weights and asking for one of them is a ValueError
    here, at load, rather than a failure inside torch."""
    check_quantization_device(mode, device)
    if mode != "auto":
        return mode
    on_cpu = device_type(device) == "cpu"
    block_quantized = source_weight_type is not None and \
        source_weight_type not in FLOAT_SOURCE_TYPES
    if on_cpu and block_quantized and (dtype == torch.bfloat16 or dtype_is_default):
        return "fp8" if source_weight_type == "fp8" else "gguf"
    return "none"


def _quantized_head(linear: nn.Linear, mode: str, dtype: torch.dtype, ops) -> nn.Module:
    """The LM head in int8 in every quantized mode: at one row it is a third of the bytes a step
    reads once the layers are int4. With a vectorised kernel build, groupwise (Q8_0-exact, our
    kernel); otherwise per channel on torch's int8 kernel; w8a8 also runs it on int8 units for
    batches."""
    if mode == "w8a8":
        return W8A8Linear(linear, dtype, ops)
    if _has_vector_kernels(ops) and linear.in_features % 32 == 0:
        return Int8GroupwiseLinear(linear, dtype, ops, LM_HEAD_INT8_KERNEL_MAX_ROWS,
                                   int8_activations=mode in ("w4a8", "gguf", "fp8"))
    return Int8WeightOnlyLinear(linear, dtype, max_rows=LM_HEAD_WEIGHT_ONLY_MAX_ROWS)


def _quantized(linear: nn.Linear, mode: str, dtype: torch.dtype, ops,
               absmax: torch.Tensor | None = None) -> nn.Module:
    if mode == "w4a8" and _has_int4_kernel(ops, dtype):
        return W4A8Linear(linear, dtype, ops)
    if mode in ("int4", "w4a8"):  # w4a8 without our vector kernels: int4 with float activations
        return Int4WeightOnlyLinear(linear, dtype, ops)
    if mode == "int8" and _has_vector_kernels(ops) and linear.in_features % 32 == 0:
        return Int8GroupwiseLinear(linear, dtype, ops, LM_HEAD_INT8_KERNEL_MAX_ROWS)
    if mode == "int8":
        return Int8WeightOnlyLinear(linear, dtype, absmax=absmax)
    return W8A8Linear(linear, dtype, ops, absmax)
