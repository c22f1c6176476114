// The fused per-layer ops of cpu_kernels.cpp, for C++ callers (decode_stack.cpp); Python reaches
// the same functions through the extension module.
#pragma once

#include <ATen/ATen.h>

namespace kvserve::layer_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    double weight_offset);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                   double weight_offset);
void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                     double weight_offset);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim);
void paged_attention_(const at::Tensor& qkv, const at::Tensor& kv_cache, at::Tensor& out,
                      const at::Tensor& seq_ids, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                      int64_t sliding_window, double softcap,
                      const c10::optional<at::Tensor>& sinks = c10::nullopt);

}  // namespace kvserve::layer_ops
