// Tiled causal attention over paged bf16 K/V (flash_attention.cpp).
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: halves the compile time of each source

namespace kvserve {

// Whether this build can run flash_attention_ for this head size (AVX512-BF16, D 64 or 128).
bool flash_attention_supported(int64_t head_dim);

// Same arguments as paged_attention_: the sequences in seq_ids attend causally over their cached
// K/V (this step's included); out [T, H * D] gets their rows. bf16 only. sliding_window > 0:
// a query at position p sees keys k with p - k < sliding_window only.
void flash_attention_(const at::Tensor& qkv, const at::Tensor& kv_cache, at::Tensor& out,
                      const at::Tensor& seq_ids, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                      int64_t sliding_window, double softcap = 0.0);

}  // namespace kvserve
