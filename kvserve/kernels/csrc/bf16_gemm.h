// bf16 weight GEMM for a few rows (decode batches in lossless bf16 mode), bf16_gemm.cpp.
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: halves the compile time of each source

namespace kvserve {

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in float, in x's dtype (float32 or
// bfloat16), with w the bf16 weights in the panel layout of kvserve/kernels/reference.py::
// pack_bf16: uint8 [ceil(N / 16), K / 32, 1024], per (panel of 16 rows, 32 along K) 16 chunks of
// 64 bytes, chunk c holding the pair (w[n, 2c], w[n, 2c + 1]) of row n at bytes 4n..4n+3.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace kvserve
