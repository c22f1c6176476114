// int4 weight-only GEMM for a few rows (decode batches), int4_gemm.cpp.
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: halves the compile time of each source

namespace kvserve {

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w = (q - 8) * scale + zero per group of 32
// along K, accumulated in float, returned in x's dtype (float32 or bfloat16). The weights come in
// the panel layout of kvserve/kernels/reference.py::pack_int4: uint8 [P, G, B] for P = ceil(N / 16)
// panels of 16 output rows and G = K / 32 groups, each block of B bytes holding 256 bytes of codes
// then 16 scales and 16 zeros, bfloat16 (B = 320) or float32 (B = 384).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features);

// Whether int4_linear runs vectorised on this build (AVX2 or AVX-512); otherwise a scalar loop.
bool int4_linear_fast();

}  // namespace kvserve
