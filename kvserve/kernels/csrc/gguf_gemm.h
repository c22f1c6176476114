// GGUF block formats kept as the file stores them (gguf_layouts.h): packing, dequantizing, and
// linear layers over them (gguf_pack.cpp, gguf_gemm.cpp). qtype is gguf's GGMLQuantizationType
// name: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "q8_rows.h"

namespace kvserve {

// raw: uint8 [N, row_bytes], a GGUF tensor's bytes (rows possibly reordered by the caller) ->
// panels uint8 [ceil(N / 16), blocks a row, panel block bytes]; rows past N are zero.
at::Tensor gguf_pack(const at::Tensor& raw, const std::string& qtype,
                     const c10::optional<at::Tensor>& out = c10::nullopt);

// Rows `rows` (int64 [R]) or begin..end - 1 of gguf_pack's panels for K = cols -> [R, K] in
// dtype (float32 or bfloat16): gguf.quants.dequantize's float32 values to the bit, then cast.
at::Tensor gguf_dequantize(const at::Tensor& panels, const std::string& qtype,
                           const at::Tensor& rows, int64_t cols, at::ScalarType dtype);
at::Tensor gguf_dequantize_range(const at::Tensor& panels, const std::string& qtype,
                                 int64_t begin, int64_t end, int64_t cols, at::ScalarType dtype);

// y = x' W.T (+ bias), x' = x rounded per group of 32 to int8 steps (int4_linear_q8's), integer
// dot products with the file's codes; x float32 or bfloat16 [M, K], y in x's dtype.
at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& panels, const std::string& qtype,
                          const c10::optional<at::Tensor>& bias, int64_t out_features);

// gguf_linear_q8 with x rounded per super-block of 256 (one step for 8 groups: llama.cpp's Q8_K
// activations) for the K-quants (Q4_K, Q5_K, Q6_K): the sub-blocks' integer scales applied in
// int32, the float work once a super-block; a clear error for the other types.
at::Tensor gguf_linear_q8k(const at::Tensor& x, const at::Tensor& panels,
                           const std::string& qtype, const c10::optional<at::Tensor>& bias,
                           int64_t out_features);

// The integer-dot path as the engine runs it (StoredLinear, StackLinear): gguf_linear_q8k for a
// K-quant call of at least kSuperBlockMinRows rows, gguf_linear_q8 otherwise.
// Why: the super-block kernel does the float work once per 256 values, not once per 32, and its
// passes fit the registers (gguf_gemm.cpp): a Q4_K gate_up at 64-512 rows ran at ~700 G
// multiply-adds a second against ~600 (Zen 5), 280 against 212 on AVX2. Below a pass of rows a
// call streams its weights at the memory's pace either way, so decode keeps x's finer steps
// per 32. x at one step per 256 is llama.cpp's own rounding for every K-quant product (Q8_K).
// KVSERVE_GGUF_SUPERBLOCKS=0 (or set_gguf_superblocks(false)) keeps every call per 32.
constexpr int64_t kSuperBlockMinRows = 8;
at::Tensor gguf_linear_int(const at::Tensor& x, const at::Tensor& panels, const std::string& qtype,
                           const c10::optional<at::Tensor>& bias, int64_t out_features);
bool gguf_takes_superblocks(const std::string& qtype, int64_t rows);
bool gguf_superblocks_enabled();
void set_gguf_superblocks(bool enabled);

// gguf_linear_q8's kernel for qtype over a span of rows and panels, with the code order its x
// needs: for callers that run their own parallel region (moe.cpp).
// For a call of `rows` rows, as gguf_linear_int would run it: step_groups says how x must be
// quantized for it (q8::size_rows).
struct SpanKernel {
  q8::PanelKernel run = nullptr;
  q8::CodeOrder order = q8::CodeOrder::kInt4Lanes;
  int64_t step_groups = 1;
};
SpanKernel gguf_span_kernel(const std::string& qtype, int64_t rows);

// y = x W.T (+ bias) with the file's exact weights in x's dtype: slabs of rows dequantized into a
// scratch buffer and multiplied by at::linear (oneDNN / MKL), never the whole matrix at once; or,
// for bfloat16 x and Q4_K/Q5_K/Q6_K where gguf_amx_takes, on AMX tiles (gguf_amx.h).
at::Tensor gguf_linear_dequant(const at::Tensor& x, const at::Tensor& panels,
                               const std::string& qtype, const c10::optional<at::Tensor>& bias,
                               int64_t out_features);

}  // namespace kvserve
