// Tiled (flash-style) causal attention over paged bf16 K/V, for sequences with many new tokens:
// prompt chunks on top of a cached prefix (shared-prefix and multi-turn traffic) and fresh
// prompts.
//
// Why: the two-pass paged kernel keeps every query row's scores for the whole context and
// reduces each (query, key) dot product horizontally; for 64 new tokens over 1,088 cached ones it
// ran at ~30 GFLOP/s. Here each task takes 16 new tokens x the query heads of one KV head
// through the context 16 keys at a time with an online softmax, and both products run on
// AVX512-BF16 dot-product instructions (vdpbf16ps: 32 multiply-adds each) against K and V tiles
// transposed once per tile into the pair layout those instructions want, so every K/V byte read
// serves up to 48 query rows.
//
// Numerics: Q.K in bf16 x bf16 with float accumulation (exact products); the probabilities are
// rounded to bf16 for P.V (as GPU flash attention does); softmax statistics and the output
// accumulate in float. Tests compare against the float reference within bf16 tolerance.
#include "flash_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace kvserve {

namespace {

constexpr int KEY_TILE = 16;       // keys per tile: one zmm of float scores per query row
constexpr int QUERY_TOKENS = 16;   // new tokens per task
constexpr int ROW_BLOCK = 4;       // query rows processed together (independent FMA chains)

using at::BFloat16;

struct FlashArgs {
  const int32_t* seq_ids;
  const int64_t* query_start;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t table_stride, block_size, num_heads, num_kv_heads, head_dim;
  float scale;
  const BFloat16* qkv;
  int64_t qkv_stride;
  const BFloat16* cache;
  int64_t cache_half;  // elements between the K and V halves of the cache
  BFloat16* out;
  int64_t out_stride;
};

struct Task {
  int64_t seq, kv_head, first_token, num_tokens;
};

#if defined(__AVX512BF16__)
// Per-thread tiles: K as [D/2][16 keys] bf16 pairs along D (for Q.K), V as [8 key pairs][D] bf16
// pairs along the keys (for P.V); the running output, max and sum of each query row.
struct Scratch {
  std::vector<uint32_t> k_tile, v_tile;
  std::vector<float> acc, row_max, row_sum;
  std::vector<int64_t> row_limit;  // keys < row_limit are visible to the row
  void reserve(int64_t rows, int64_t dim) {
    k_tile.assign(dim / 2 * KEY_TILE, 0);
    v_tile.assign(KEY_TILE / 2 * dim, 0);
    acc.assign(rows * dim, 0.f);
    row_max.assign(rows, -std::numeric_limits<float>::infinity());
    row_sum.assign(rows, 0.f);
    row_limit.assign(rows, 0);
  }
};

// Address of key position `pos` of a sequence for one KV head (K half; V is cache_half later).
inline const BFloat16* key_row(const FlashArgs& a, const int32_t* table, int64_t pos,
                               int64_t kv_head) {
  const int64_t slot = static_cast<int64_t>(table[pos / a.block_size]) * a.block_size +
                       pos % a.block_size;
  return a.cache + slot * a.num_kv_heads * a.head_dim + kv_head * a.head_dim;
}

// Transpose up to 16 key rows into pairs along D: k_tile[p * 16 + i] = (k_i[2p], k_i[2p + 1]).
// Missing keys (past the sequence's end) are zero; their scores are masked anyway.
void pack_keys(const BFloat16* const* rows, int count, int64_t dim, uint32_t* k_tile) {
  const int64_t pairs = dim / 2;
  for (int i = 0; i < KEY_TILE; ++i) {
    if (i < count) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(rows[i]);
      for (int64_t p = 0; p < pairs; ++p) k_tile[p * KEY_TILE + i] = src[p];
    } else {
      for (int64_t p = 0; p < pairs; ++p) k_tile[p * KEY_TILE + i] = 0;
    }
  }
}

// Interleave pairs of value rows: v_tile[j * dim + d] = (v_{2j}[d], v_{2j+1}[d]), 16 d per
// permute; missing rows are zero (their probabilities are zero too).
void pack_values(const BFloat16* const* rows, int count, int64_t dim, uint32_t* v_tile) {
  static const __m512i low = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i high = _mm512_set_epi16(
      63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  const __m512i zero = _mm512_setzero_si512();
  for (int j = 0; j < KEY_TILE / 2; ++j) {
    const BFloat16* even = 2 * j < count ? rows[2 * j] : nullptr;
    const BFloat16* odd = 2 * j + 1 < count ? rows[2 * j + 1] : nullptr;
    for (int64_t d = 0; d < dim; d += 32) {
      __m512i a = even ? _mm512_loadu_si512(even + d) : zero;
      __m512i b = odd ? _mm512_loadu_si512(odd + d) : zero;
      _mm512_storeu_si512(v_tile + j * dim + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(v_tile + j * dim + d + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// Scores of R query rows against the 16 keys of the tile (D / 2 dot-product steps each).
template <int R>
inline void score_rows(const uint32_t* const* queries, const uint32_t* k_tile, int64_t dim,
                       __m512* scores) {
  for (int r = 0; r < R; ++r) scores[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(k_tile + p * KEY_TILE);
    for (int r = 0; r < R; ++r) {
      scores[r] = _mm512_dpbf16_ps(scores[r], (__m512bh)_mm512_set1_epi32(queries[r][p]), k);
    }
  }
}

// Online softmax step for one row: returns the bf16 probabilities (as 8 key pairs) of this tile
// and rescales the row's running sum and output by exp(old max - new max).
inline __m256i softmax_step(__m512 scores, __mmask16 visible, float& row_max, float& row_sum,
                            float* acc, int64_t dim) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  scores = _mm512_mask_blend_ps(visible, neg_inf, scores);
  const float tile_max = _mm512_reduce_max_ps(scores);
  const float new_max = std::max(row_max, tile_max);
  __m512 probs = _mm512_maskz_mov_ps(visible, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
  if (new_max > row_max) {  // rescale what came before (exp(-inf) = 0 on the first tile)
    const float correction = std::exp(row_max - new_max);
    row_sum *= correction;
    const __m512 c = _mm512_set1_ps(correction);
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(c, _mm512_loadu_ps(acc + d)));
    row_max = new_max;
  }
  row_sum += _mm512_reduce_add_ps(probs);
  __m256bh packed = _mm512_cvtneps_pbh(probs);
  return reinterpret_cast<__m256i&>(packed);
}

// acc[r] += P[r] . V for R rows; V pairs are read once per row block.
template <int R, int DIM>
inline void weigh_rows(const __m256i* probs, const uint32_t* v_tile, float* const* acc) {
  constexpr int C = DIM / 16;
  __m512 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_loadu_ps(acc[r] + 16 * c);
  alignas(64) uint32_t pairs[R][8];
  for (int r = 0; r < R; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), probs[r]);
  for (int j = 0; j < KEY_TILE / 2; ++j) {
    for (int c = 0; c < C; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(v_tile + j * DIM + 16 * c);
      for (int r = 0; r < R; ++r) {
        sum[r][c] = _mm512_dpbf16_ps(sum[r][c], (__m512bh)_mm512_set1_epi32(pairs[r][j]), v);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[r] + 16 * c, sum[r][c]);
}

// One block of up to ROW_BLOCK query rows through one key tile.
template <int R, int DIM>
void row_block_step(const FlashArgs& a, const Task& t, Scratch& s, int64_t row0, int64_t tile0,
                    int keys_in_tile) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const uint32_t* queries[R];
  float* acc[R];
  __m512 scores[R];
  __m256i probs[R];
  const int64_t q_begin = a.query_start[t.seq] + t.first_token;
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r, token = row / group, head = t.kv_head * group + row % group;
    queries[r] = reinterpret_cast<const uint32_t*>(a.qkv + (q_begin + token) * a.qkv_stride +
                                                   head * DIM);
    acc[r] = s.acc.data() + row * DIM;
  }
  score_rows<R>(queries, s.k_tile.data(), DIM, scores);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int r = 0; r < R; ++r) {
    const int64_t limit = std::min<int64_t>(s.row_limit[row0 + r] - tile0, keys_in_tile);
    const __mmask16 visible = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(limit, 0))));
    probs[r] = softmax_step(_mm512_mul_ps(scores[r], _mm512_set1_ps(a.scale)), visible,
                            s.row_max[row0 + r], s.row_sum[row0 + r], acc[r], DIM);
  }
  weigh_rows<R, DIM>(probs, s.v_tile.data(), acc);
}

template <int DIM>
void run_task(const FlashArgs& a, const Task& t, Scratch& s) {
  const int64_t group = a.num_heads / a.num_kv_heads, rows = t.num_tokens * group;
  const int64_t seq_len = a.seq_lens[t.seq];
  const int64_t n_new = a.query_start[t.seq + 1] - a.query_start[t.seq];
  const int64_t first_pos = seq_len - n_new + t.first_token;  // absolute position of row 0
  s.reserve(rows, DIM);
  for (int64_t r = 0; r < rows; ++r) s.row_limit[r] = first_pos + r / group + 1;
  const int64_t key_end = first_pos + t.num_tokens;  // exclusive: the last row's limit
  const int32_t* table = a.tables + t.seq * a.table_stride;
  const BFloat16* rows_k[KEY_TILE];
  const BFloat16* rows_v[KEY_TILE];
  for (int64_t tile0 = 0; tile0 < key_end; tile0 += KEY_TILE) {
    const int count = static_cast<int>(std::min<int64_t>(KEY_TILE, key_end - tile0));
    for (int i = 0; i < count; ++i) {
      rows_k[i] = key_row(a, table, tile0 + i, t.kv_head);
      rows_v[i] = rows_k[i] + a.cache_half;
    }
    pack_keys(rows_k, count, DIM, s.k_tile.data());
    pack_values(rows_v, count, DIM, s.v_tile.data());
    // rows whose limit is at or before this tile see none of it: start at the first that does
    int64_t row0 = 0;
    while (row0 < rows && s.row_limit[row0] <= tile0) ++row0;
    for (; row0 < rows; row0 += ROW_BLOCK) {
      const int64_t n = std::min<int64_t>(ROW_BLOCK, rows - row0);
      switch (n) {
        case 1: row_block_step<1, DIM>(a, t, s, row0, tile0, count); break;
        case 2: row_block_step<2, DIM>(a, t, s, row0, tile0, count); break;
        case 3: row_block_step<3, DIM>(a, t, s, row0, tile0, count); break;
        default: row_block_step<4, DIM>(a, t, s, row0, tile0, count); break;
      }
    }
  }
  const int64_t q_begin = a.query_start[t.seq] + t.first_token;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = r / group, head = t.kv_head * group + r % group;
    float* acc = s.acc.data() + r * DIM;
    const __m512 inv = _mm512_set1_ps(1.f / s.row_sum[r]);
    BFloat16* dst = a.out + (q_begin + token) * a.out_stride + head * DIM;
    for (int64_t d = 0; d < DIM; d += 16) {
      __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(acc + d)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i&>(packed));
    }
  }
}
#endif

std::vector<Task> plan_tasks(const FlashArgs& a, int64_t num_seqs) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t seq = a.seq_ids[i];
    const int64_t n = a.query_start[seq + 1] - a.query_start[seq];
    // later tiles see more keys: emit them first so the longest tasks start early
    for (int64_t first = ((n - 1) / QUERY_TOKENS) * QUERY_TOKENS; first >= 0; first -= QUERY_TOKENS) {
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        tasks.push_back({seq, h, first, std::min<int64_t>(QUERY_TOKENS, n - first)});
      }
    }
  }
  return tasks;
}

}  // namespace

bool flash_attention_supported(int64_t head_dim) { return bf16_attention_supported(head_dim); }

void flash_attention_(const at::Tensor& qkv, const at::Tensor& kv_cache, at::Tensor& out,
                      const at::Tensor& seq_ids, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(flash_attention_supported(head_dim),
              "flash_attention_: needs AVX512-BF16 and head_dim 64 or 128");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "flash_attention_: bfloat16 qkv, cache and out expected");
  TORCH_CHECK(seq_ids.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kLong,
              "flash_attention_: int32 ids/lens/tables and int64 query_start_loc expected");
  TORCH_CHECK(block_tables.is_contiguous() && out.stride(1) == 1 && qkv.stride(1) == 1 &&
                  kv_cache.is_contiguous(),
              "flash_attention_: bad layout");
#if defined(__AVX512BF16__)
  FlashArgs a{seq_ids.data_ptr<int32_t>(), query_start_loc.data_ptr<int64_t>(),
              seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
              block_tables.size(1), kv_cache.size(2), num_heads, num_kv_heads, head_dim,
              static_cast<float>(scale), qkv.data_ptr<BFloat16>(), qkv.stride(0),
              kv_cache.data_ptr<BFloat16>(), kv_cache.stride(0), out.data_ptr<BFloat16>(),
              out.stride(0)};
  const std::vector<Task> tasks = plan_tasks(a, seq_ids.numel());
  // Tasks differ in length (later query tiles see more keys): threads take them one by one.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      if (head_dim == 64) run_task<64>(a, tasks[i], scratch);
      else run_task<128>(a, tasks[i], scratch);
    }
  });
#endif
}

}  // namespace kvserve
