// Paged attention for bf16 sequences with few new tokens (decodes, short chunks), on AVX512-BF16.
//
// Why: the float two-pass kernel in cpu_kernels.cpp converts every K and V row to float and
// reduces each (query, key) dot product horizontally; at batch 32 over ~300 cached tokens it took
// ~0.43 ms per layer, a third of a W8A8 decode step. Here Q.K runs on vdpbf16ps straight from the
// bf16 cache rows, and the horizontal sums of 16 keys are done together by one transpose-add
// tree; P.V runs on vdpbf16ps too, on value rows interleaved in pairs. Same two passes (all
// scores, then softmax, then the weighted values), so one task still reads each K and V row once.
//
// Numerics: exact bf16 products accumulated in float for Q.K (as the float kernel); the softmax
// in float; probabilities rounded to bf16 for P.V, as the flash kernel and GPU flash attention.
#include "decode_attention.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "vec.h"

namespace kvserve {

#if defined(__AVX512BF16__)
namespace {

using at::BFloat16;

// The 16 lane sums of a[0..15], in order, as one vector: a transpose-and-add tree (45 ops for 16
// sums instead of 16 full horizontal reductions).
inline __m512 sum16(const __m512* a) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d u = _mm512_castps_pd(pairs[2 * i]), v = _mm512_castps_pd(pairs[2 * i + 1]);
    // the unpacks move float pairs as 64-bit units; the add is on floats
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  // quads[i], 128-bit chunk c: partial sums over chunk c of vectors 4i..4i+3; add the chunks
  auto fold = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  return fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]));
}

template <int DIM>
inline void prefetch_row(const BFloat16* row) {
  for (int offset = 0; offset < DIM * 2; offset += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + offset, _MM_HINT_T0);
  }
}

template <int DIM>
inline void score_tile(const uint32_t* query, const BFloat16* const* keys, float scale,
                       float* scores) {
  constexpr int C = DIM / 32;  // 32 bf16 per vector
  __m512bh q[C];
  for (int c = 0; c < C; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 16 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c), q[c]);
    }
    acc[j] = sum;
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

// Value rows 2j and 2j+1 interleaved: out[c] holds (v_2j[d], v_2j+1[d]) for d in 16c..16c+15.
template <int DIM>
inline void pack_value_pair(const BFloat16* even, const BFloat16* odd, __m512bh* out) {
  for (int c = 0; c < DIM / 32; ++c) {
    __m512i low, high;
    interleave_bf16(_mm512_loadu_si512(even + 32 * c),
                    odd ? _mm512_loadu_si512(odd + 32 * c) : _mm512_setzero_si512(), low, high);
    out[2 * c] = (__m512bh)low;
    out[2 * c + 1] = (__m512bh)high;
  }
}

// acc rows (R of them, DIM floats each) = sum over keys of probability * value row.
template <int DIM, int R>
void weigh_values(const DecodeTask& t, const BFloat16* const* key_rows,
                  const uint16_t* const* probs, int64_t num_keys, float* const* acc) {
  constexpr int C = DIM / 16;
  __m512 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
  __m512bh values[C];
  for (int64_t j = 0; j < num_keys; j += 2) {
    for (int64_t k = j + 16; k < std::min<int64_t>(j + 18, num_keys); ++k) {
      prefetch_row<DIM>(key_rows[k] + t.cache_half);
    }
    const BFloat16* odd = j + 1 < num_keys ? key_rows[j + 1] + t.cache_half : nullptr;
    pack_value_pair<DIM>(key_rows[j] + t.cache_half, odd, values);
    for (int r = 0; r < R; ++r) {
      uint32_t pair = probs[r][j];
      if (odd) pair |= static_cast<uint32_t>(probs[r][j + 1]) << 16;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], p, values[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[r] + 16 * c, sum[r][c]);
}

// Scores (scaled) of one query row against keys [0, num_keys), 16 at a time.
template <int DIM>
void score_row(const DecodeTask& t, const BFloat16* query, int64_t num_keys, float* scores,
               std::vector<const BFloat16*>& key_rows) {
  const uint32_t* q = reinterpret_cast<const uint32_t*>(query);
  for (int64_t j0 = 0; j0 < num_keys; j0 += 16) {
    // the rows lie scattered over blocks (and strided by the other heads): fetch the next tile's
    // while this one computes
    for (int64_t j = j0 + 16; j < std::min<int64_t>(j0 + 32, num_keys); ++j) {
      prefetch_row<DIM>(key_rows[j]);
    }
    const BFloat16* keys[16];
    for (int j = 0; j < 16; ++j) keys[j] = key_rows[std::min<int64_t>(j0 + j, num_keys - 1)];
    score_tile<DIM>(q, keys, t.scale, scores + j0);  // scores past num_keys are never read
  }
}

// Keys are indexed from key0 (the first one the first query sees): key j is position key0 + j.
template <int DIM>
void run(const DecodeTask& t, DecodeScratch& s) {
  const int64_t first_pos = t.seq_len - t.num_tokens;
  const int64_t key0 = t.window > 0 ? std::max<int64_t>(0, first_pos - t.window + 1) : 0;
  const int64_t rows = t.num_tokens * t.group, keys = t.seq_len - key0;
  const int64_t padded = (keys + 15) / 16 * 16;
  s.scores.resize(rows * padded);
  s.probs.resize(rows * (padded + 2));
  s.acc.resize(rows * DIM);
  s.key_rows.resize(keys);
  t.key_rows(key0, keys, s.key_rows.data());
  for (int64_t r = 0; r < rows; ++r) {
    // causal: keys up to this row's own; in the window: not `window` or more behind it
    const int64_t visible = first_pos + r / t.group + 1 - key0;
    const int64_t lo = t.window > 0 ? std::max<int64_t>(0, visible - t.window) : 0;
    float* scores = s.scores.data() + r * padded;
    score_row<DIM>(t, t.query_row(r), visible, scores, s.key_rows);
    const int64_t seen = visible - lo;
    const float inv = 1.f / exp_shifted_sum(scores + lo, seen, max_of(scores + lo, seen));
    for (int64_t j = lo; j < visible; ++j) scores[j] *= inv;
    std::fill(scores, scores + lo, 0.f);
    std::fill(scores + visible, scores + keys, 0.f);
    uint16_t* p = s.probs.data() + r * (padded + 2);
    to_bf16_bits(scores, p, keys);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int64_t n = std::min<int64_t>(4, rows - r0);
    const uint16_t* probs[4];
    float* acc[4];
    int64_t last_visible = 0;
    for (int64_t r = 0; r < n; ++r) {
      probs[r] = s.probs.data() + (r0 + r) * (padded + 2);
      acc[r] = s.acc.data() + (r0 + r) * DIM;
      last_visible = first_pos + (r0 + r) / t.group + 1 - key0;
    }
    switch (n) {
      case 1: weigh_values<DIM, 1>(t, s.key_rows.data(), probs, last_visible, acc); break;
      case 2: weigh_values<DIM, 2>(t, s.key_rows.data(), probs, last_visible, acc); break;
      case 3: weigh_values<DIM, 3>(t, s.key_rows.data(), probs, last_visible, acc); break;
      default: weigh_values<DIM, 4>(t, s.key_rows.data(), probs, last_visible, acc); break;
    }
    for (int64_t r = 0; r < n; ++r) t.store_row(r0 + r, acc[r]);
  }
}

}  // namespace
#endif

bool decode_attention_supported(int64_t head_dim) { return bf16_attention_supported(head_dim); }

void decode_attention_task(const DecodeTask& task, DecodeScratch& scratch) {
#if defined(__AVX512BF16__)
  if (task.head_dim == 64) run<64>(task, scratch);
  else run<128>(task, scratch);
#else
  (void)task;
  (void)scratch;
#endif
}

}  // namespace kvserve
