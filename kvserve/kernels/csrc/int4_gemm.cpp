// int4 weight-only GEMM for few rows: the decoder projections of decode steps (Int4WeightOnlyLinear
// takes it up to 64 rows; beyond, the bf16 GEMM of its dense copy wins).
//
// Why: torch's _weight_int4pack_mm_for_cpu read ~21 GB/s here, and batches over 4 rows fell back
// to a bf16 copy of the weights, 4x the bytes. Decode is bound by reading the weights, so this
// kernel reads each block once per call whatever the row count, in one sequential stream per
// thread, prefetched, with few instructions per byte (gate_up at one row: ~45 GB/s).
//
// Layout (reference.py::pack_int4): output rows in panels of 16, one float lane each; per (panel,
// group of 32 along K) one block: 256 bytes of codes, then the 16 rows' scales, then their zeros
// (bf16 or float: 320 or 384 bytes, whole cache lines). The codes are 4 chunks of 64 bytes = 32
// little-endian 16-bit words; chunk c, word e, nibble j (bits 4j..4j+3) holds
// q[16p + e / 2][32g + 8c + 2j + e % 2]. With 0x000F / 0x4300 masks a chunk becomes 4 vectors of
// 32 bf16, one (n, k-pair) per 32-bit lane: the operand order of vdpbf16ps, so lane n
// accumulates w[n, k] x[k] + w[n, k+1] x[k+1] against x's pair (k, k+1) broadcast straight from
// bf16 x. bf16 bits 0x4300 | q are exactly 128 + q, so each group's dot is sum (128 + q) x, and
//   y[n] = sum_g scale[n, g] * dot[n, g] + (zero[n, g] - 136 scale[n, g]) * xsum[g]
// with xsum[g] the group's sum of x. The unpacked weights serve up to 10 rows of x (8 on AVX2)
// from registers (loop m innermost), which is what makes batches of 8-64 cheap: there the kernel
// is bound by vdpbf16ps throughput (one per 32 multiply-adds), as a bf16 GEMM would be, on 1/4
// the bytes.
// float32 x takes the same loop with the bf16 lanes split into two float vectors (exact: 128 + q
// and x in float, products by FMA).
#include "int4_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "panel_layouts.h"
#include "vec.h"

namespace kvserve {
namespace {

using at::BFloat16;

constexpr int64_t kGroup = kInt4Group;
constexpr int64_t kPanel = kInt4Panel;
constexpr int64_t kChunkBytes = kInt4ChunkBytes;
// Rows of x per pass over a panel's codes (a 9-token verification as 8 + 1 paid the unpacking
// twice). On AVX-512 up to 10 rows share it: per row, 9 and 10 cost what 8 do, 12 and 16 more
// (Zen 4, SmolLM2's shapes: 16 rows 403 us in one pass, 364 in two of 8). AVX2 has 16 registers.
constexpr int kRowBlock = KVSERVE_VEC == 16 ? 10 : 8;
constexpr float kCodeOffset = 136.f;                // 128 from the bf16 trick + the 8 of q - 8
constexpr int64_t kPrefetchBlocks = kInt4PrefetchBlocks;
template <typename S> using Block = Int4Block<S>;

inline float widen(float v) { return v; }
inline float widen(BFloat16 v) { return static_cast<float>(v); }

// Plain loops over the same layout, for the portable scalar build.
template <typename T, typename S>
void int4_linear_scalar(const T* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                        const T* bias, int64_t out_features, int64_t groups, T* y) {
  at::parallel_for(0, out_features, kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < rows; ++m) {
        float acc = bias ? widen(bias[n]) : 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = packed + ((n / kPanel) * groups + g) * Block<S>::kBytes;
          const float scale = widen(Block<S>::scales(block)[n % kPanel]);
          const float zero = widen(Block<S>::zeros(block)[n % kPanel]);
          for (int64_t k = 0; k < kGroup; ++k) {
            const float w = (int4_code_at(block, n, k) - 8) * scale + zero;
            acc += w * widen(x[m * ldx + g * kGroup + k]);
          }
        }
        y[m * out_features + n] = static_cast<T>(acc);
      }
    }
  });
}

#if KVSERVE_VEC

// Sum of each group of 32 values of each row: xsum[m][g], float.
template <typename T>
void group_sums(const T* x, int64_t rows, int64_t ldx, int64_t groups, float* xsum) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = x + m * ldx + g * kGroup;
      float sum = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) sum += widen(src[i]);
      xsum[m * groups + g] = sum;
    }
  }
}

#endif

#if KVSERVE_VEC == 16

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// One chunk (64 bytes) -> 4 vectors of 32 bf16 holding 128 + q: 7 integer ops, no shuffles.
inline void unpack_chunk(const uint8_t* src, __m512i out[4]) {
  const __m512i words = _mm512_loadu_si512(src);
  const __m512i low4 = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  constexpr int kAndOr = 0xEA;  // ternary logic (A & B) | C
  out[0] = _mm512_ternarylogic_epi32(words, low4, exponent, kAndOr);
  out[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), low4, exponent, kAndOr);
  out[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), low4, exponent, kAndOr);
  out[3] = _mm512_or_si512(_mm512_srli_epi16(words, 12), exponent);
}

// acc[n] += w[n, k] x[k] + w[n, k+1] x[k+1]; `x` points at x[k], w holds (k, k+1) per lane.
inline __m512 multiply_add_pair(__m512 acc, __m512i w, const float* x) {
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF0000)));
  acc = _mm512_fmadd_ps(even, _mm512_set1_ps(x[0]), acc);
  return _mm512_fmadd_ps(odd, _mm512_set1_ps(x[1]), acc);
}

#if defined(__AVX512BF16__)
inline __m512 multiply_add_pair(__m512 acc, __m512i w, const BFloat16* x) {
  // vdpbf16ps with x's pair as an embedded {1to16} broadcast: GCC emits a separate vpbroadcastd
  // for the intrinsic, one extra op per vdpbf16ps (measured: 7-8% at 8-16 rows).
  asm("vdpbf16ps %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}
#endif

// out[m][0..15] = one panel's 16 outputs for rows 0..R-1 of x (no bias); `panel` is its first
// block, xsum [R][groups].
template <int R, typename T, typename S>
void panel_rows(const T* x, int64_t ldx, const uint8_t* panel, const float* xsum,
                int64_t groups, float* out) {
  // Independent vdpbf16ps chains (latency 6): with few rows, two per row (alternate k-pairs),
  // measured 5-10% faster at 2-4 rows; with more rows the rows are enough.
  constexpr int C = R <= 4 ? 2 : 1;
  // the running totals live in the L1 tile `out` (a load and a store per row and group against
  // 16 vdpbf16ps): registers go to the dot chains of up to kRowBlock rows
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * kPanel, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + g * Block<S>::kBytes;
    int4_prefetch_block<S>(block + kPrefetchBlocks * Block<S>::kBytes);
    __m512 dot[R][C];
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < C; ++c) dot[m][c] = _mm512_setzero_ps();
    for (int chunk = 0; chunk < 4; ++chunk) {
      __m512i w[4];
      unpack_chunk(block + chunk * kChunkBytes, w);
      for (int j = 0; j < 4; ++j) {
        const int64_t k = g * kGroup + chunk * 8 + 2 * j;
        for (int m = 0; m < R; ++m)
          dot[m][j % C] = multiply_add_pair(dot[m][j % C], w[j], x + m * ldx + k);
      }
    }
    const __m512 scale = load16(Block<S>::scales(block));
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(kCodeOffset), scale,
                                           load16(Block<S>::zeros(block)));
    for (int m = 0; m < R; ++m) {
      __m512 dsum = dot[m][0];
      for (int c = 1; c < C; ++c) dsum = _mm512_add_ps(dsum, dot[m][c]);
      __m512 total = _mm512_fmadd_ps(dsum, scale, _mm512_loadu_ps(out + m * kPanel));
      total = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * groups + g]), total);
      _mm512_storeu_ps(out + m * kPanel, total);
    }
  }
}

template <typename T, typename S>
void panel_rows(int rows, const T* x, int64_t ldx, const uint8_t* panel, const float* xsum,
                int64_t groups, float* out) {
  switch (rows) {
#define KVSERVE_ROWS_CASE(R) \
  case R: return panel_rows<R, T, S>(x, ldx, panel, xsum, groups, out);
    KVSERVE_ROWS_CASE(1) KVSERVE_ROWS_CASE(2) KVSERVE_ROWS_CASE(3) KVSERVE_ROWS_CASE(4)
    KVSERVE_ROWS_CASE(5) KVSERVE_ROWS_CASE(6) KVSERVE_ROWS_CASE(7) KVSERVE_ROWS_CASE(8)
    KVSERVE_ROWS_CASE(9) KVSERVE_ROWS_CASE(10)
#undef KVSERVE_ROWS_CASE
    default: TORCH_CHECK(false, "int4_linear: bad row block ", rows);
  }
}

// 16 floats (+ bias) -> y's dtype; only the first `count` lanes are written (the last panel).
inline void store_panel(const float* values, const float* bias, int count, float* dst) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
  __m512 v = _mm512_loadu_ps(values);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias));
  _mm512_mask_storeu_ps(dst, lanes, v);
}

inline void store_panel(const float* values, const float* bias, int count, BFloat16* dst) {
  float row[kPanel];
  store_panel(values, bias, kPanel, row);
  uint16_t bits[kPanel];
  to_bf16_bits(row, bits, kPanel);
  std::memcpy(dst, bits, count * sizeof(uint16_t));
}

#elif KVSERVE_VEC == 8

// AVX2: each 64-byte chunk is two 32-byte halves, output rows 0-7 and 8-15 of the panel, one
// float lane each; a half's 32-bit lane n holds (even k, odd k) codes of row n. With the same
// 0x000F / 0x4300 masks as the AVX-512 path, nibble j of both words becomes bf16 128 + q; a shift
// and a mask make them two float vectors, scaled once per group (exact: (128 + q) * a bf16 scale
// fits in a float's mantissa) and then shared by up to 8 rows of x, each broadcast per k.
//
// The group's dot products accumulate unscaled (128 + q times x, exact enough in float: < 2^8 *
// 32 terms of x) and are scaled once per group, not per weight: at one row the loop is bound by
// vector ops per weight, and the two multiplies per 16 weights were a fifth of them. Rows are few,
// so each row keeps dot chains for even and odd k, two of each with 1-2 rows, to keep FMAs in flight.
template <int R, typename S>
void half_panel_rows(const float* x, int64_t ldx, const uint8_t* panel, const float* xsum,
                     int64_t groups, int half, float* out) {
  constexpr int C = R <= 2 ? 2 : 1;
  const __m256i low4 = _mm256_set1_epi32(0x000F000F), exponent = _mm256_set1_epi32(0x43004300);
  const __m256i high_word = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + g * Block<S>::kBytes;
    if (half == 0) int4_prefetch_block<S>(block + kPrefetchBlocks * Block<S>::kBytes);
    __m256 dot_even[R][C], dot_odd[R][C];
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < C; ++c) dot_even[m][c] = dot_odd[m][c] = _mm256_setzero_ps();
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m256i words = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(block + chunk * kChunkBytes + 32 * half));
      for (int j = 0; j < 4; ++j) {
        const __m256i w = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32(words, 4 * j), low4), exponent);
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high_word));
        const int64_t k = g * kGroup + chunk * 8 + 2 * j;
        for (int m = 0; m < R; ++m) {
          __m256& de = dot_even[m][j % C];
          __m256& dd = dot_odd[m][j % C];
          de = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x + m * ldx + k), de);
          dd = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x + m * ldx + k + 1), dd);
        }
      }
    }
    const __m256 scale = vload(Block<S>::scales(block) + 8 * half);
    const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(kCodeOffset), scale,
                                           vload(Block<S>::zeros(block) + 8 * half));
    for (int m = 0; m < R; ++m) {
      __m256 dot = _mm256_add_ps(dot_even[m][0], dot_odd[m][0]);
      for (int c = 1; c < C; ++c)
        dot = _mm256_add_ps(dot, _mm256_add_ps(dot_even[m][c], dot_odd[m][c]));
      total[m] = _mm256_fmadd_ps(dot, scale, total[m]);
      total[m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[m * groups + g]), total[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm256_storeu_ps(out + m * kPanel + 8 * half, total[m]);
}

template <typename T, typename S>
void panel_rows(int rows, const T* x, int64_t ldx, const uint8_t* panel, const float* xsum,
                int64_t groups, float* out) {
  static_assert(std::is_same<T, float>::value, "AVX2 int4: bf16 x is widened by the caller");
  for (int half = 0; half < 2; ++half) {
    switch (rows) {
#define KVSERVE_ROWS_CASE(R) \
  case R: half_panel_rows<R, S>(x, ldx, panel, xsum, groups, half, out); break;
      KVSERVE_ROWS_CASE(1) KVSERVE_ROWS_CASE(2) KVSERVE_ROWS_CASE(3) KVSERVE_ROWS_CASE(4)
      KVSERVE_ROWS_CASE(5) KVSERVE_ROWS_CASE(6) KVSERVE_ROWS_CASE(7) KVSERVE_ROWS_CASE(8)
#undef KVSERVE_ROWS_CASE
      default: TORCH_CHECK(false, "int4_linear: bad row block ", rows);
    }
  }
}

// 16 floats (+ bias) -> y; only the first `count` lanes are written (the last panel).
inline void store_panel(const float* values, const float* bias, int count, float* dst) {
  for (int i = 0; i < count; ++i) dst[i] = values[i] + (bias ? bias[i] : 0.f);
}

#endif

#if KVSERVE_VEC

template <typename T, typename S>
void int4_linear_vec(const T* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                        const T* bias, int64_t out_features, int64_t groups, T* y) {
  std::vector<float> xsum(rows * groups);
  group_sums(x, rows, ldx, groups, xsum.data());
  std::vector<float> bias_f(bias ? out_features + kPanel : 0, 0.f);
  for (int64_t n = 0; bias && n < out_features; ++n) bias_f[n] = widen(bias[n]);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const int64_t panel_bytes = groups * Block<S>::kBytes;
  const int64_t block = rows_per_pass(rows, kRowBlock);
  // Each thread takes one contiguous run of panels: a single stream of blocks.
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    float tile[kRowBlock * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int count = static_cast<int>(std::min(kPanel, out_features - p * kPanel));
      const float* panel_bias = bias ? bias_f.data() + p * kPanel : nullptr;
      // every row block re-reads the panel's blocks, from L1 after the first (<= 15 KB at K=1536)
      for (int64_t m0 = 0; m0 < rows; m0 += block) {
        const int block_rows = static_cast<int>(std::min<int64_t>(block, rows - m0));
        panel_rows<T, S>(block_rows, x + m0 * ldx, ldx, packed + p * panel_bytes,
                         xsum.data() + m0 * groups, groups, tile);
        for (int m = 0; m < block_rows; ++m)
          store_panel(tile + m * kPanel, panel_bias, count,
                      y + (m0 + m) * out_features + p * kPanel);
      }
    }
  });
}

#endif  // KVSERVE_VEC

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

template <typename T, typename S>
void int4_linear_typed(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t rows = x.size(0), groups = x.size(1) / kGroup, out_features = y.size(1);
  const T* bias_ptr = bias ? bias->data_ptr<T>() : nullptr;
#if KVSERVE_VEC
  if constexpr (std::is_same<T, BFloat16>::value && !kHasBf16Dot) {
    // no vdpbf16ps: the float loop on float copies of x and bias (small next to the weights)
    at::Tensor y_float = at::empty(y.sizes(), y.options().dtype(at::kFloat));
    auto bias_float = bias ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    int4_linear_typed<float, S>(x.to(at::kFloat), packed, bias_float, y_float);
    y.copy_(y_float);
  } else {
    int4_linear_vec<T, S>(x.data_ptr<T>(), rows, x.stride(0), packed.data_ptr<uint8_t>(),
                             bias_ptr, out_features, groups, y.data_ptr<T>());
  }
#else
  int4_linear_scalar<T, S>(x.data_ptr<T>(), rows, x.stride(0), packed.data_ptr<uint8_t>(),
                           bias_ptr, out_features, groups, y.data_ptr<T>());
#endif
}

void check_inputs(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kGroup == 0,
              "int4_linear: x must be [M, K] rows with K divisible by 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_linear: x must be float32 or bfloat16");
  const int64_t panels = (out_features + kPanel - 1) / kPanel, groups = x.size(1) / kGroup;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == panels && packed.size(1) == groups &&
                  (packed.size(2) == Block<BFloat16>::kBytes ||
                   packed.size(2) == Block<float>::kBytes),
              "int4_linear: packed must be uint8 [ceil(N / 16), K / 32, 320 or 384]");
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                        bias->numel() == out_features),
              "int4_linear: bias must be [N] in x's dtype");
}

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_inputs(x, packed, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
  const bool bf16_meta = packed.size(2) == Block<BFloat16>::kBytes;
  if (x.scalar_type() == at::kBFloat16) {
    bf16_meta ? int4_linear_typed<BFloat16, BFloat16>(x, packed, bias, y)
              : int4_linear_typed<BFloat16, float>(x, packed, bias, y);
  } else {
    bf16_meta ? int4_linear_typed<float, BFloat16>(x, packed, bias, y)
              : int4_linear_typed<float, float>(x, packed, bias, y);
  }
  return y;
}

bool int4_linear_fast() {
#if KVSERVE_VEC
  return true;
#else
  return false;
#endif
}

}  // namespace kvserve
