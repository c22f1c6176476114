// Top-p and the draw without sorting the vocabulary, a row per task.
//
// On flat rows (random-token prompts, high temperatures) the nucleus spans thousands of tokens,
// and torch's way to it (topk windows that widen, then a sort of 49k logits) cost ~2.7 ms a row;
// the whole-vocabulary exponential noise of the Gumbel-max draw another ~1.5 ms. Here the
// nucleus comes from a histogram of each row's mass by distance below its best logit: the
// buckets before the one where the running mass reaches top_p are kept whole, those after it
// dropped whole, and only that one bucket is sorted. The draw is an inverse CDF of one uniform
// over the masses e^(logit - best), summed in blocks (no softmax tensor, no noise).
#include "sampling.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"

namespace kvserve {
namespace {

// 4,096 buckets of 1/64 logit: a trained model's flat row puts ~100 tokens in the busiest one.
// Everything more than 64 below the best (each < e^-64 of it) shares the last bucket.
constexpr int kBuckets = 4096;
constexpr float kBucketsPerLogit = 64.0f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Monotone in the logit (a rounded difference, scaled, truncated): a better token never lands in
// a later bucket, so buckets in order are the sort's order up to the order within a bucket.
inline int32_t bucket_of(float best, float logit) {
  const float distance = (best - logit) * kBucketsPerLogit;
  if (!(distance < static_cast<float>(kBuckets - 1))) return kBuckets - 1;  // also NaN, inf
  return static_cast<int32_t>(distance);
}

// e^x for x <= 0, in float64 to about an ulp: Cody-Waite reduction by ln 2, then Taylor to r^13
// (|r| <= ln2 / 2: the first term left out is < 1e-17). std::exp cost ~20 ns a token, a
// millisecond a row; the vector form does four at a time. Tokens below e^-708 get 0: their mass
// is under float64's resolution of any row's total. Multiplies and adds, never fused, so the
// vector and scalar forms give the same bits.
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2Hi = 0x1.62e42fee00000p-1;  // its low bits zero: k * kLn2Hi is exact
constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;
constexpr double kShifter = 0x1.8p52;  // adding it rounds to an integer in the low mantissa bits
constexpr int64_t kShifterBits = 0x4338000000000000LL;
constexpr double kTaylor[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0,
                              1.0 / 3628800.0,    1.0 / 362880.0,    1.0 / 40320.0,
                              1.0 / 5040.0,       1.0 / 720.0,       1.0 / 120.0,
                              1.0 / 24.0,         1.0 / 6.0,         0.5,
                              1.0,                1.0};  // 1/13! .. 1/0!, Horner's order

inline double exp_nonpositive(double x) {
  const double shifted = x * kLog2e + kShifter;
  const double k = shifted - kShifter;
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = kTaylor[0];
  for (int i = 1; i < 14; ++i) p = p * r + kTaylor[i];
  int64_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  const int64_t scale_bits = (bits - kShifterBits + 1023) << 52;
  double scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return x > -708.0 ? p * scale : 0.0;
}

// e^(logit - best) of one token.
inline double mass_of(float logit, double best) {
  return exp_nonpositive(static_cast<double>(logit) - best);
}

#if KVSERVE_VEC
// The 256-bit form serves the AVX-512 builds too: the double-precision work is a small part of
// a step, and one form keeps both levels' bits equal.
inline __m256d exp_nonpositive4(__m256d x) {
  const __m256d shifter = _mm256_set1_pd(kShifter);
  const __m256d shifted = _mm256_add_pd(_mm256_mul_pd(x, _mm256_set1_pd(kLog2e)), shifter);
  const __m256d k = _mm256_sub_pd(shifted, shifter);
  const __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(k, _mm256_set1_pd(kLn2Hi))),
                                  _mm256_mul_pd(k, _mm256_set1_pd(kLn2Lo)));
  __m256d p = _mm256_set1_pd(kTaylor[0]);
  for (int i = 1; i < 14; ++i) p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(kTaylor[i]));
  const __m256i exponent = _mm256_add_epi64(
      _mm256_sub_epi64(_mm256_castpd_si256(shifted), _mm256_set1_epi64x(kShifterBits)),
      _mm256_set1_epi64x(1023));
  const __m256d value = _mm256_mul_pd(p, _mm256_castsi256_pd(_mm256_slli_epi64(exponent, 52)));
  return _mm256_and_pd(value, _mm256_cmp_pd(x, _mm256_set1_pd(-708.0), _CMP_GT_OQ));
}

// mass_of for the 4 tokens at row[0..3].
inline __m256d mass_of4(const float* row, __m256d best) {
  return exp_nonpositive4(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(row)), best));
}

// bucket_of for the 8 tokens at row[0..7].
inline __m256i bucket_of8(const float* row, __m256 best) {
  const __m256 distance =
      _mm256_mul_ps(_mm256_sub_ps(best, _mm256_loadu_ps(row)), _mm256_set1_ps(kBucketsPerLogit));
  const __m256 inside = _mm256_cmp_ps(distance, _mm256_set1_ps(kBuckets - 1), _CMP_LT_OQ);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(kBuckets - 1)),
                                              _mm256_castsi256_ps(_mm256_cvttps_epi32(distance)),
                                              inside));
}
#endif

// The row's best logit; NaN when the row has one.
float row_peak(const float* row, int64_t vocab) {
  bool has_nan;
  const float peak = max_of_checked(row, vocab, has_nan);
  return has_nan ? std::numeric_limits<float>::quiet_NaN() : peak;
}

// Each bucket's float64 mass, in one pass over the row.
void fill_histogram(const float* row, int64_t vocab, float peak, std::vector<double>& mass) {
  std::fill(mass.begin(), mass.end(), 0.0);
  int64_t i = 0;
#if KVSERVE_VEC
  const __m256 peak8 = _mm256_set1_ps(peak);
  const __m256d peak4 = _mm256_set1_pd(peak);
  alignas(32) int32_t buckets[8];
  alignas(32) double masses[8];
  for (; i + 8 <= vocab; i += 8) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(buckets), bucket_of8(row + i, peak8));
    _mm256_store_pd(masses, mass_of4(row + i, peak4));
    _mm256_store_pd(masses + 4, mass_of4(row + i + 4, peak4));
    for (int j = 0; j < 8; ++j) mass[buckets[j]] += masses[j];
  }
#endif
  for (; i < vocab; ++i) mass[bucket_of(peak, row[i])] += mass_of(row[i], peak);
}

// -inf on every token past bucket `cut`; returns the tokens of bucket `cut` best first (lowest
// ids first on ties: the stable sort's order).
std::vector<std::pair<float, int64_t>> drop_past(float* row, int64_t vocab, float peak, int cut) {
  std::vector<std::pair<float, int64_t>> members;
  int64_t i = 0;
#if KVSERVE_VEC
  const __m256 peak8 = _mm256_set1_ps(peak);
  const __m256i cut8 = _mm256_set1_epi32(cut);
  for (; i + 8 <= vocab; i += 8) {
    const __m256i buckets = bucket_of8(row + i, peak8);
    const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(buckets, cut8));
    const __m256 kept = _mm256_loadu_ps(row + i);
    _mm256_storeu_ps(row + i, _mm256_blendv_ps(kept, _mm256_set1_ps(kNegInf), past));
    int at = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(buckets, cut8)));
    for (; at; at &= at - 1) {
      const int64_t token = i + __builtin_ctz(at);
      members.emplace_back(row[token], token);
    }
  }
#endif
  for (; i < vocab; ++i) {
    const int32_t bucket = bucket_of(peak, row[i]);
    if (bucket == cut) members.emplace_back(row[i], i);
    if (bucket > cut) row[i] = kNegInf;
  }
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  return members;
}

// -inf outside the row's nucleus, in place. The buckets before the one where the running mass
// reaches top_p are kept whole, those after it dropped whole; in that one the sort's walk: a
// token stays while the mass before it is under top_p (the row's best always stays).
void keep_nucleus(float* row, int64_t vocab, double top_p, std::vector<double>& mass) {
  const float peak = row_peak(row, vocab);
  if (std::isnan(peak) || !std::isfinite(peak) || !(top_p < 1.0)) return;  // keep everything
  fill_histogram(row, vocab, peak, mass);
  double total = 0.0;
  for (const double m : mass) total += m;
  const double target = top_p * total;
  double before = 0.0;
  int cut = 0;  // an empty bucket never holds the cut: before < target stays true through it
  for (; cut < kBuckets - 1 && before + mass[cut] < target; ++cut) before += mass[cut];
  const auto members = drop_past(row, vocab, peak, cut);
  size_t kept = 0;
  while (kept < members.size() && (before < target || (cut == 0 && kept == 0))) {
    before += mass_of(members[kept].first, peak);  // bucket 0 holds the best: it always stays
    ++kept;
  }
  for (size_t m = kept; m < members.size(); ++m) row[members[m].second] = kNegInf;
}

// The blocks the draw sums first, then walks one of token by token.
constexpr int64_t kDrawBlock = 256;
constexpr float kDrawExpLow = -87.0f;  // e^-87 of the best: a mass of 0 (and -inf never drawn)

// e^(logit - best) of row[0..size) in float32, into `out`: the draw needs a sampler's precision,
// not the float64 that places a top-p cut exactly.
void block_masses(const float* row, int64_t size, float peak, float* out) {
  int64_t i = 0;
#if KVSERVE_VEC
  const vf best = vset1(peak);
  for (; i + kLanes <= size; i += kLanes) {
    const vf x = vsub(vload(row + i), best);
#if KVSERVE_VEC == 16
    vstore(out + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(kDrawExpLow), _CMP_GE_OQ),
                                        vexp(x)));
#else
    vstore(out + i, _mm256_and_ps(vexp(x), _mm256_cmp_ps(x, vset1(kDrawExpLow), _CMP_GE_OQ)));
#endif
  }
#endif
  for (; i < size; ++i) {
    const float x = row[i] - peak;
    out[i] = x >= kDrawExpLow ? std::exp(x) : 0.0f;
  }
}

double sum_of(const float* values, int64_t size) {
  double lanes[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= size; i += 4) {
    for (int j = 0; j < 4; ++j) lanes[j] += values[i + j];
  }
  for (; i < size; ++i) lanes[0] += values[i];
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

// The first token whose running float64 sum of masses exceeds `uniform` x the row's: block
// sums first, then token by token inside the block that holds it.
int64_t draw_row(const float* row, int64_t vocab, double uniform, std::vector<double>& blocks) {
  const float peak = row_peak(row, vocab);
  if (std::isnan(peak) || !std::isfinite(peak)) return 0;
  const int64_t num_blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  auto block_size = [&](int64_t b) { return std::min(kDrawBlock, vocab - b * kDrawBlock); };
  float masses[kDrawBlock];
  blocks.resize(num_blocks);
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    block_masses(row + b * kDrawBlock, block_size(b), peak, masses);
    blocks[b] = sum_of(masses, block_size(b));
    total += blocks[b];
  }
  const double target = uniform * total;
  double running = 0.0;
  int64_t b = 0;
  for (; b < num_blocks - 1 && (blocks[b] == 0.0 || running + blocks[b] <= target); ++b) {
    running += blocks[b];
  }
  while (b > 0 && blocks[b] == 0.0) --b;  // the target rounded up to the total: the last mass
  block_masses(row + b * kDrawBlock, block_size(b), peak, masses);
  int64_t chosen = b * kDrawBlock;
  for (int64_t i = 0; i < block_size(b); ++i) {
    if (masses[i] == 0.0f) continue;
    chosen = b * kDrawBlock + i;
    running += masses[i];
    if (running > target) break;  // else the block's sum rounded above its running sum
  }
  return chosen;
}


// -inf at every token of `out[0, 32)` whose bit in `bits` is clear (a word of a token bitmask).
inline void mask_word(float* out, uint32_t bits) {
#if KVSERVE_VEC == 16
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>(~bits & 0xFFFFu), ninf);
  _mm512_mask_storeu_ps(out + 16, static_cast<__mmask16>(~bits >> 16), ninf);
#elif KVSERVE_VEC == 8
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  for (int k = 0; k < 4; ++k) {
    const __m256i byte = _mm256_set1_epi32(static_cast<int>((bits >> (8 * k)) & 0xFFu));
    const __m256i allowed = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bits), lane_bits);
    const __m256 kept = _mm256_loadu_ps(out + 8 * k);
    _mm256_storeu_ps(out + 8 * k, _mm256_blendv_ps(ninf, kept, _mm256_castsi256_ps(allowed)));
  }
#else
  for (int j = 0; j < 32; ++j) {
    if (!((bits >> j) & 1u)) out[j] = kNegInf;
  }
#endif
}

// One row: -inf wherever its bitmask's bit is clear; left alone when the mask allows no token
// of the row (sampling from nothing but -inf would give NaN).
void mask_row(float* row, int64_t vocab, const uint32_t* bits) {
  const int64_t full = vocab / 32, tail = vocab % 32;
  const uint32_t tail_bits = tail ? (bits[full] & ((1u << tail) - 1u)) : 0u;
  bool any = tail_bits != 0;
  for (int64_t w = 0; w < full && !any; ++w) any = bits[w] != 0;
  if (!any) return;
  for (int64_t w = 0; w < full; ++w) {
    if (bits[w] != 0xFFFFFFFFu) mask_word(row + 32 * w, bits[w]);  // most words: all or none
  }
  for (int64_t j = 0; j < tail; ++j) {
    if (!((tail_bits >> j) & 1u)) row[32 * full + j] = kNegInf;
  }
}

void check_rows(const at::Tensor& rows, const at::Tensor& per_row, const char* name) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.stride(1) == 1,
              name, ": float32 [R, V] rows expected");
  TORCH_CHECK(per_row.dim() == 1 && per_row.scalar_type() == at::kDouble &&
                  per_row.size(0) == rows.size(0) && per_row.is_contiguous(),
              name, ": one float64 value per row expected");
}

}  // namespace

void top_p_mask_(at::Tensor& logits, const at::Tensor& top_p) {
  check_rows(logits, top_p, "top_p_mask_");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  float* base = logits.data_ptr<float>();
  const double* p = top_p.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> mass(kBuckets);
    for (int64_t r = begin; r < end; ++r) {
      keep_nucleus(base + r * logits.stride(0), vocab, p[r], mass);
    }
  });
}

at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& uniforms) {
  check_rows(logits, uniforms, "draw_rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> blocks;
    for (int64_t r = begin; r < end; ++r) {
      out.data_ptr<int64_t>()[r] = draw_row(logits.data_ptr<float>() + r * logits.stride(0),
                                            vocab, uniforms.data_ptr<double>()[r], blocks);
    }
  });
  return out;
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                          const at::Tensor& mask_rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: float32 [R, V] logits expected");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask_: int32 [M, ceil(V / 32)] bitmask expected");
  TORCH_CHECK(rows.dim() == 1 && mask_rows.dim() == 1 && rows.scalar_type() == at::kLong &&
                  mask_rows.scalar_type() == at::kLong && rows.size(0) == mask_rows.size(0) &&
                  rows.is_contiguous() && mask_rows.is_contiguous(),
              "apply_token_bitmask_: int64 rows and mask_rows of one length expected");
  const int64_t count = rows.size(0), vocab = logits.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* mask_row_of = mask_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0) && mask_row_of[i] >= 0 &&
                    mask_row_of[i] < bitmask.size(0),
                "apply_token_bitmask_: a row index is out of range");
  }
  float* base = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      mask_row(base + row[i] * logits.stride(0), vocab, bits + mask_row_of[i] * bitmask.size(1));
    }
  });
}

}  // namespace kvserve
