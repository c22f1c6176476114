// Integer-dot GEMVs with int8 activations for few rows (decode batches), q8_dot_gemm.cpp.
#pragma once

#include <ATen/ATen.h>

#include "q8_rows.h"

namespace kvserve {

// y = x' @ W.T (+ bias) with x' = x rounded per group of 32 along K to int8 steps of its absmax
// (x' = d * round(x / d), d = absmax / 127) and W int4 in int4_linear's panel layout, except that
// the two metadata arrays hold (scale, low), w = q * scale + low, in float16 (320-byte blocks) or
// float32 (384); float32 or bfloat16 x, y in x's dtype. Lossy in x only: the integer dot
// products are exact.
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features);

// The same with W int8 groupwise (GGUF Q8_0) in int8_linear's panel layout.
at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features);

// Whether this build multiplies a whole 16-output panel per instruction (AVX512-VNNI zmm), where
// integer dot products do twice the multiply-adds of bf16 ones: `--quantization auto` then picks
// w4a8 over int4 in bfloat16 (quant/linear.py::resolve_quantization).
bool q8_dot_wide();

// The span kernels behind int4_linear_q8 (x's codes in CodeOrder::kInt4Lanes) and
// int8_linear_q8 (kNatural), for callers that run their own parallel region (moe.cpp).
q8::PanelKernel int4_q8_kernel();
q8::PanelKernel int8_q8_kernel();

}  // namespace kvserve
