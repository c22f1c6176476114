// Paged attention over bf16 K/V for few new tokens per sequence (decode_attention.cpp).
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: halves the compile time of each source

#include <algorithm>
#include <vector>

#include "vec.h"

namespace kvserve {

// One (sequence, KV head): its num_tokens new tokens x `group` query heads against keys
// [0, seq_len) of its block table (the new tokens' K/V included, causal). window > 0: a query at
// position p sees keys k with p - k < window only, and keys (blocks) before the first query's
// window are never read.
struct DecodeTask {
  const at::BFloat16* qkv;
  int64_t qkv_stride, q_begin;  // the first new token's row in qkv
  const at::BFloat16* cache;
  int64_t cache_half;           // elements from a K row to its V row
  const int32_t* table;
  int64_t block_size, num_kv_heads, kv_head, group, head_dim, num_tokens, seq_len, window;
  float scale;
  at::BFloat16* out;
  int64_t out_stride;

  // Query row r: token r / group, query head kv_head * group + r % group.
  const at::BFloat16* query_row(int64_t r) const {
    return qkv + (q_begin + r / group) * qkv_stride + (kv_head * group + r % group) * head_dim;
  }
  const at::BFloat16* key_row(int64_t pos) const {
    return cache + cache_row_offset(table, block_size, num_kv_heads, head_dim, pos, kv_head);
  }
  // rows[j] = key_row(first + j) for j < count, a block at a time (a division a key was ~15%
  // of a 16-sequence decode layer's time over ~600 cached tokens, Zen 5)
  void key_rows(int64_t first, int64_t count, const at::BFloat16** rows) const {
    const int64_t stride = num_kv_heads * head_dim;
    for (int64_t j = 0; j < count;) {
      const at::BFloat16* row = key_row(first + j);
      const int64_t run = std::min(count - j, block_size - (first + j) % block_size);
      for (int64_t i = 0; i < run; ++i, ++j) rows[j] = row + i * stride;
    }
  }
  void store_row(int64_t r, const float* values) const {
    at::BFloat16* dst = out + (q_begin + r / group) * out_stride +
                        (kv_head * group + r % group) * head_dim;
    to_bf16_bits(values, reinterpret_cast<uint16_t*>(dst), head_dim);
  }
};

// Per-thread buffers, reused across tasks.
struct DecodeScratch {
  std::vector<float> scores, acc;
  std::vector<uint16_t> probs;
  std::vector<const at::BFloat16*> key_rows;
};

// Whether this build runs decode_attention_task for this head size (AVX512-BF16, D 64 or 128).
bool decode_attention_supported(int64_t head_dim);

void decode_attention_task(const DecodeTask& task, DecodeScratch& scratch);

}  // namespace kvserve
