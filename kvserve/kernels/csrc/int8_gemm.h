// int8 groupwise weight-only GEMM for a few rows (the LM head of decode steps), int8_gemm.cpp.
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: halves the compile time of each source

namespace kvserve {

// y[m, n] = sum_k x[m, k] * q[n, k] * scale[n, k / 32] (+ bias[n]), accumulated in float,
// returned in x's dtype (float32 or bfloat16; bf16 x of 3+ rows on vdpbf16ps where the CPU has
// it). Weights in the panel layout of kvserve/kernels/reference.py::pack_int8: uint8
// [ceil(N / 16), K / 32, 576], each block holding 8 chunks of 64 bytes (chunk c: the 16 rows'
// codes for k = 4c..4c+3, 4 bytes per row) then the 16 rows' float32 scales. GGUF's Q8_0
// (symmetric int8 per 32 with an fp16 scale) maps onto it exactly.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace kvserve
