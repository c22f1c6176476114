// A stage of decoder layers in one call: see decode_stack.h for why. Every op here is the one
// the Python fused path calls, with the same arguments, so outputs are identical; the Python
// side (LlamaModel) decides per step whether the stack applies and `--enforce-eager` turns it
// off.
#include "decode_stack.h"

#include "bf16_gemm.h"
#include "flash_attention.h"
#include "int4_gemm.h"
#include "layer_ops.h"
#include "q8_dot_gemm.h"

namespace kvserve {

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (kind == "dense" || x.size(0) > max_rows) return at::linear(x, dense, bias);
  if (kind == "int4_q8") return int4_linear_q8(x, panels, bias, out_features);
  if (kind == "int4") return int4_linear(x, panels, bias, out_features);
  if (kind == "bf16") return bf16_linear(x, panels, bias, out_features);
  TORCH_CHECK(false, "decode stack: unknown projection kind ", kind);
}

DecodeStack::DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, double eps,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double scale)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), scale_(scale),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {
  for (const StackLayer& layer : layers_) {
    for (const StackLinear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      TORCH_CHECK(linear->kind == "dense" || linear->kind == "int4_q8" ||
                      linear->kind == "int4" || linear->kind == "bf16",
                  "decode stack: unknown projection kind ", linear->kind);
    }
  }
}

at::Tensor DecodeStack::run(at::Tensor residual, const at::Tensor& positions,
                            const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
                            const at::Tensor& seq_ids, const at::Tensor& flash_seq_ids,
                            const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables) const {
  at::Tensor hidden;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& layer = layers_[i];
    if (i == 0) {
      hidden = layer_ops::rms_norm(residual, layer.input_norm, eps_);
    } else {
      layer_ops::add_rms_norm_(hidden, residual, layer.input_norm, eps_);
    }
    at::Tensor qkv = layer.qkv(hidden);
    at::Tensor kv_cache = layer.kv_cache;
    layer_ops::rope_and_cache_(qkv, positions, cos_sin, kv_cache, slot_mapping, num_heads_,
                               num_kv_heads_, head_dim_);
    at::Tensor attended = at::empty({qkv.size(0), num_heads_ * head_dim_}, qkv.options());
    if (seq_ids.numel()) {
      layer_ops::paged_attention_(qkv, kv_cache, attended, seq_ids, query_start_loc, seq_lens,
                                  block_tables, num_heads_, num_kv_heads_, head_dim_, scale_,
                                  layer.sliding_window);
    }
    if (flash_seq_ids.numel()) {
      flash_attention_(qkv, kv_cache, attended, flash_seq_ids, query_start_loc, seq_lens,
                       block_tables, num_heads_, num_kv_heads_, head_dim_, scale_,
                       layer.sliding_window);
    }
    hidden = layer.o(attended);
    layer_ops::add_rms_norm_(hidden, residual, layer.post_attention_norm, eps_);
    hidden = layer.down(layer_ops::silu_and_mul(layer.gate_up(hidden)));
  }
  layer_ops::add_rms_norm_(hidden, residual, final_norm_, eps_);
  return hidden;
}

}  // namespace kvserve
