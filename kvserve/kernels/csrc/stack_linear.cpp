// StackLinear (stack_linear.h): the kernel the Python path's projection would call for x's rows.
#include "stack_linear.h"

#include "bf16_gemm.h"
#include "gguf_gemm.h"
#include "int4_gemm.h"
#include "q8_dot_gemm.h"

namespace kvserve {

bool StackLinear::known_kind(const std::string& kind) {
  return kind == "dense" || kind == "int4_q8" || kind == "int4" || kind == "bf16" ||
         kind == "gguf" || kind == "concat";
}

SpanKernel StackLinear::span_kernel(int64_t rows) const {
  if (kind == "gguf") return gguf_span_kernel(qtype, rows);
  if (kind == "int4_q8") return {int4_q8_kernel(), q8::CodeOrder::kInt4Lanes};
  return {};
}

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (kind == "concat") {
    std::vector<at::Tensor> outputs;
    for (const StackLinear& segment : segments) outputs.push_back(segment(x));
    return at::cat(outputs, -1);
  }
  if (kind == "gguf") {
    return x.size(0) > max_rows ? gguf_linear_dequant(x, panels, qtype, bias, out_features)
                                : gguf_linear_int(x, panels, qtype, bias, out_features);
  }
  if (kind == "dense" || x.size(0) > max_rows) return at::linear(x, dense, bias);
  if (kind == "int4_q8") return int4_linear_q8(x, panels, bias, out_features);
  if (kind == "int4") return int4_linear(x, panels, bias, out_features);
  if (kind == "bf16") return bf16_linear(x, panels, bias, out_features);
  TORCH_CHECK(false, "stack linear: unknown projection kind ", kind);
}

}  // namespace kvserve
