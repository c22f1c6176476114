// A whole stage of decoder layers as one call (decode_stack.cpp).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace kvserve {

// One projection as the model holds it: which kernel serves few rows, its weights in that
// kernel's layout, the dense copy for more rows (or the only weights, kind "dense").
struct StackLinear {
  std::string kind;  // "int4", "int4_q8", "bf16" or "dense"
  at::Tensor panels, dense;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0, max_rows = 0;

  at::Tensor operator()(const at::Tensor& x) const;
};

struct StackLayer {
  at::Tensor input_norm, post_attention_norm, kv_cache;
  StackLinear qkv, o, gate_up, down;
  int64_t sliding_window = 0;
};

// The decoder layers of a Llama-family model on the fused path (LlamaModel._forward_fused), in
// C++: the same ops in the same order, so the same results to the bit, without ~9 Python calls
// per layer (~270 a step for SmolLM2), each with its attribute lookups and binding overhead.
// Each sequence takes the attention kernel the Python path plans for it: the paged kernel
// (decodes, chunks of 1-3 tokens) or, in bfloat16 over a bf16 cache, the flash kernel (from 4 new
// tokens: verifications of drafts, prompts); steps that need SDPA or a dequantized cache stay
// in Python.
class DecodeStack {
 public:
  DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, double eps,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);

  // residual: the embedded tokens [T, H] (updated in place, as the Python path does); returns
  // the final normed hidden states [T, H].
  at::Tensor run(at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos_sin,
                 const at::Tensor& slot_mapping, const at::Tensor& seq_ids,
                 const at::Tensor& flash_seq_ids, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                 const at::Tensor& block_tables) const;

 private:
  std::vector<StackLayer> layers_;
  at::Tensor final_norm_;
  double eps_, scale_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
};

}  // namespace kvserve
