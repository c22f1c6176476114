// One projection as the model holds it, callable from C++ (the decode stack, the fused MoE):
// which kernel serves few rows, its weights in that kernel's layout, the dense copy for more rows.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "gguf_gemm.h"

namespace kvserve {

// kind "dense": only `dense`; "int4", "int4_q8", "bf16": panels for up to max_rows rows, `dense`
// above; "gguf": a file's blocks of `qtype` (gguf_gemm.h: integer dots for few rows, dequantized
// slabs above); "concat": `segments` side by side (a projection whose parts the file stores in
// two types).
struct StackLinear {
  std::string kind;  // "int4", "int4_q8", "bf16", "dense", "gguf" or "concat"
  at::Tensor panels, dense;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0, max_rows = 0;
  std::string qtype;
  std::vector<StackLinear> segments;

  at::Tensor operator()(const at::Tensor& x) const;
  // The integer-dot kernel that serves a call of `rows` (<= max_rows) rows over `panels` (kinds
  // "gguf" and "int4_q8"), for callers that schedule spans of it themselves; run is null
  // otherwise.
  SpanKernel span_kernel(int64_t rows) const;
  static bool known_kind(const std::string& kind);
};

}  // namespace kvserve
