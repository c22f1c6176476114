// The activation side of the integer-dot kernels (q8_dot_gemm.cpp, gguf_gemm.cpp): x rounded per
// group of 32 to int8 codes (llama.cpp's Q8 activations), the kernels' one parallel region (x
// quantized inside it, then panels split over threads, outputs stored as they come) and the
// row-block dispatch. Shared so every weight format dots the same codes and steps.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include <omp.h>
#include <unistd.h>

#include "panel_layouts.h"
#include "vec.h"

namespace kvserve {
namespace q8 {

using at::BFloat16;
using at::Half;

// With AVX512-VNNI the int4 kernel takes a whole panel (16 outputs) per zmm: vpdpbusd zmm does 64
// multiply-adds an instruction, twice vdpbf16ps (Zen 4: one of either a cycle, measured), and the
// per-row epilogue serves 16 outputs, not 8; the Q8_0 head likewise. AVX2 keeps ymm halves.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVSERVE_Q8_ZMM 1
#else
#define KVSERVE_Q8_ZMM 0
#endif

// rows of x per pass over a panel (the unpacked codes are shared); zmm: 8 code vectors, a total
// per row, and scratch fit 32 registers at 12 rows
constexpr int kRowBlock = KVSERVE_Q8_ZMM ? 12 : 8;

enum class CodeOrder { kInt4Lanes, kNatural };

// x quantized per group of 32: codes in the layout's lane order, and per (row, group) the step d
// and d * sum(codes) (the exact sum of x' = d * xq, for the int4 zero-point term); the sums of
// the codes, of the group and of its first 16 (GGUF Q6_K's sub-blocks of 16 have their own
// scales and an offset of -32, which costs -32 * scale * sum(codes) per sub-block).
//
// With step_groups = 8 (kSuperBlockGroups) one step serves a GGUF super-block of 256 values
// (llama.cpp's Q8_K activations, what its K-quant dot products take): step and sum are then
// the super-block's step repeated per group, and the code sums are also kept as int16 per 32
// (sum32) and per 16 (sum16), so the super-block kernels (gguf_gemm.cpp) read two groups' sums
// as one 32-bit pair.
constexpr int64_t kSuperBlockGroups = 8;

struct QuantizedRows {
  std::vector<int8_t> codes;  // [rows, K]
  std::vector<float> step;    // [rows, groups]
  std::vector<float> sum;     // [rows, groups]
  std::vector<int32_t> code_sum;  // [rows, groups]: sum of the group's codes
  std::vector<int32_t> half_sum;  // [rows, groups]: sum of its first 16 codes
  std::vector<int16_t> sum32;     // [rows, groups]: code_sum as int16 (super-blocks only)
  std::vector<int16_t> sum16;     // [rows, 2 groups]: each 16 codes' sum (super-blocks only)
  std::vector<int32_t> seed16;    // [rows, 2 groups]: -32 x sum16 (super-blocks only), where
                                  // the zmm Q6_K super-block kernel's sub-block dots start
  int64_t cols = 0, groups = 0;
  int64_t step_groups = 1;  // groups sharing one step: 1, or kSuperBlockGroups

  const int8_t* group_codes(int64_t m, int64_t g) const { return codes.data() + m * cols + g * 32; }
  float step_at(int64_t m, int64_t g) const { return step[m * groups + g]; }
  float sum_at(int64_t m, int64_t g) const { return sum[m * groups + g]; }
  int32_t code_sum_at(int64_t m, int64_t g) const { return code_sum[m * groups + g]; }
  int32_t half_sum_at(int64_t m, int64_t g) const { return half_sum[m * groups + g]; }
  const int16_t* sum32_at(int64_t m, int64_t g) const { return sum32.data() + m * groups + g; }
  const int16_t* sum16_at(int64_t m, int64_t g) const {
    return sum16.data() + 2 * (m * groups + g);
  }
  const int32_t* seed16_at(int64_t m, int64_t g) const {
    return seed16.data() + 2 * (m * groups + g);
  }
  // the units quantize_groups counts for `rows` rows: groups, or super-blocks
  int64_t units(int64_t rows) const { return rows * groups / step_groups; }
};

// Position in the stored group of the code of x[k] (k within the group).
inline int stored_position(int k, CodeOrder order) {
  if (order == CodeOrder::kNatural) return k;
  // chunk of 8: stored (k0, k4, k1, k5, k2, k6, k3, k7)
  static constexpr int kInChunk[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  return (k & ~7) + kInChunk[k & 7];
}

// A group's absmax, and its codes at a step (absmax_of, encode_group; quantize_group below).
#if KVSERVE_VEC
// With AVX2 (every vector build has it), equal to the scalar loop below to the bit: the absmax
// is a max (exact in any order), the product and step are the scalar's float operations, cvtps
// rounds to nearest even as nearbyint does in the default rounding mode, and the codes
// (|code| <= 127) pack without saturating. The scalar loop cost ~4 ns a value: 6 us for down's
// 1,536 inputs, on one thread while the other waits, ~0.4 ms of a batch-1 decode step.
inline __m256 load8_float(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_float(const BFloat16* p) {  // bf16 -> float is a 16-bit shift: exact
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// the largest |x| of `count` (a multiple of 8) values
template <typename T>
float absmax_of(const T* src, int64_t count) {
  __m256 absmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; i += 8)
    absmax = _mm256_max_ps(absmax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), load8_float(src + i)));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(absmax), _mm256_extractf128_ps(absmax, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
  return _mm_cvtss_f32(half);
}

// One group of 32 at a given step: its codes into dst (stored order), the sum of its first 16
// codes; returns the sum of all 32.
template <typename T>
int encode_group(const T* src, int8_t* dst, CodeOrder order, float step, int& first_half) {
  const __m256 inverse = _mm256_set1_ps(step > 0.f ? 1.f / step : 0.f);
  __m256i codes[4];
  for (int i = 0; i < 4; ++i)
    codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8_float(src + 8 * i), inverse));
  // packs work per 128-bit lane: bytes come out as 4-value runs of codes[0..3], low halves in
  // the low lane; the permute restores k order
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                           _mm256_packs_epi32(codes[2], codes[3]));
  __m256i bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (order == CodeOrder::kInt4Lanes) {  // each 8-value chunk as (k0, k4, k1, k5, ... k3, k7)
    const __m128i chunk = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    bytes = _mm256_shuffle_epi8(bytes, _mm256_broadcastsi128_si256(chunk));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  // the two halves' sums side by side: lanes 0 and 1 of `both` after the reduction
  const __m256i halves = _mm256_hadd_epi32(_mm256_add_epi32(codes[0], codes[1]),
                                           _mm256_add_epi32(codes[2], codes[3]));
  __m128i both = _mm_add_epi32(_mm256_castsi256_si128(halves),
                               _mm256_extracti128_si256(halves, 1));
  both = _mm_hadd_epi32(both, both);
  first_half = _mm_cvtsi128_si32(both);
  return first_half + _mm_extract_epi32(both, 1);
}
#else
template <typename T>
float absmax_of(const T* src, int64_t count) {
  float absmax = 0.f;
  for (int64_t k = 0; k < count; ++k) absmax = std::max(absmax, std::fabs(static_cast<float>(src[k])));
  return absmax;
}

template <typename T>
int encode_group(const T* src, int8_t* dst, CodeOrder order, float step, int& first_half) {
  const float inverse = step > 0.f ? 1.f / step : 0.f;
  int code_sum = 0;
  for (int k = 0; k < 32; ++k) {
    const int code = static_cast<int>(std::nearbyint(static_cast<float>(src[k]) * inverse));
    dst[stored_position(k, order)] = static_cast<int8_t>(code);
    code_sum += code;
    if (k == 15) first_half = code_sum;
  }
  return code_sum;
}
#endif

// One group of 32 with its own step (absmax / 127): see encode_group.
template <typename T>
int quantize_group(const T* src, int8_t* dst, CodeOrder order, float& step, int& first_half) {
  step = absmax_of(src, 32) / 127.f;
  return encode_group(src, dst, order, step, first_half);
}

// Sizes `q` for rows x cols (its buffers only grow: the caller keeps one, no allocation a call).
// With step_groups = kSuperBlockGroups, cols must be a multiple of 256.
inline void size_rows(QuantizedRows& q, int64_t rows, int64_t cols, int64_t step_groups = 1) {
  q.cols = cols;
  q.groups = cols / 32;
  q.step_groups = step_groups;
  q.codes.resize(rows * cols);
  q.step.resize(rows * q.groups);
  q.sum.resize(rows * q.groups);
  q.code_sum.resize(rows * q.groups);
  q.half_sum.resize(rows * q.groups);
  if (step_groups > 1) {
    q.sum32.resize(rows * q.groups);
    q.sum16.resize(2 * rows * q.groups);
    q.seed16.resize(2 * rows * q.groups);
  }
}

template <typename T>
void quantize_superblocks(QuantizedRows& q, const T* x, int64_t ldx, CodeOrder order,
                          int64_t begin, int64_t end);

// Units [begin, end) of x, counted over rows then groups (or super-blocks: q.units), into `q`
// (sized by size_rows): each unit's codes and step depend on that unit alone, so threads may
// take disjoint ranges.
template <typename T>
void quantize_groups(QuantizedRows& q, const T* x, int64_t ldx, CodeOrder order, int64_t begin,
                     int64_t end) {
  if (q.step_groups > 1) return quantize_superblocks(q, x, ldx, order, begin, end);
  if (begin >= end) return;
  int64_t m = begin / q.groups, g = begin % q.groups;  // one division, not one a group
  float* steps = q.step.data();
  float* sums = q.sum.data();
  int32_t* code_sums = q.code_sum.data();
  int32_t* half_sums = q.half_sum.data();
  for (int64_t i = begin; i < end; ++i) {
    float step;
    int first_half;
    const int code_sum = quantize_group(x + m * ldx + g * 32, q.codes.data() + m * q.cols + g * 32,
                                        order, step, first_half);
    steps[i] = step;
    sums[i] = step * static_cast<float>(code_sum);
    code_sums[i] = code_sum;
    half_sums[i] = first_half;
    if (++g == q.groups) g = 0, ++m;
  }
}

// Super-blocks [begin, end) (over rows, then super-blocks): one step for the 8 groups, from the
// super-block's absmax; the groups' codes as encode_group gives them at that step.
template <typename T>
void quantize_superblocks(QuantizedRows& q, const T* x, int64_t ldx, CodeOrder order,
                          int64_t begin, int64_t end) {
  const int64_t per_row = q.groups / q.step_groups;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t m = unit / per_row, g0 = (unit % per_row) * q.step_groups;
    const T* src = x + m * ldx + g0 * 32;
    const float step = absmax_of(src, 32 * q.step_groups) / 127.f;
    for (int64_t g = g0; g < g0 + q.step_groups; ++g) {
      const int64_t i = m * q.groups + g;
      int first_half;
      const int code_sum = encode_group(src + (g - g0) * 32, q.codes.data() + m * q.cols + g * 32,
                                        order, step, first_half);
      q.step[i] = step;
      q.sum[i] = step * static_cast<float>(code_sum);
      q.code_sum[i] = code_sum;
      q.half_sum[i] = first_half;
      q.sum32[i] = static_cast<int16_t>(code_sum);  // |sum| <= 32 * 127
      q.sum16[2 * i] = static_cast<int16_t>(first_half);
      q.sum16[2 * i + 1] = static_cast<int16_t>(code_sum - first_half);
      q.seed16[2 * i] = -32 * first_half;
      q.seed16[2 * i + 1] = -32 * (code_sum - first_half);
    }
  }
}

// Where a call's outputs go: row m's outputs at m * ld, in float or as bf16 bits, bias added in
// float first (the order the unfused path had, so results are unchanged).
struct OutputRows {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  const float* bias = nullptr;
  int64_t ld = 0;

  // values[0 .. count) are row m's outputs n0 ..; values is scratch (the bias lands in it)
  void store(int64_t m, int64_t n0, float* values, int64_t count) const {
    if (bias)
      for (int64_t i = 0; i < count; ++i) values[i] += bias[n0 + i];
    if (f32) {
      std::copy(values, values + count, f32 + m * ld + n0);
    } else {
      to_bf16_bits(values, bf16 + m * ld + n0, count);
    }
  }
};

inline float widen(float v) { return v; }
inline float widen(Half v) { return static_cast<float>(v); }

#if KVSERVE_VEC
inline __m256i broadcast_code_word(const int8_t* codes) {
  int32_t word;
  std::memcpy(&word, codes, sizeof(word));
  return _mm256_set1_epi32(word);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

#if KVSERVE_Q8_ZMM
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc += w (u8) . x's 4 codes (s8) broadcast to every lane, with the broadcast embedded in the
// instruction ({1to16}) rather than a separate vpbroadcastd (as int4_gemm.cpp's vdpbf16ps).
inline __m512i dot_add_broadcast(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// init + the dot products of Count (even) code vectors with x's codes (4 a vector, in order),
// in two chains added at the end (exact): one chain of 8 dependent vpdpbusd (5 cycles each) a
// row kept ~10 rows' chains waiting in the scheduler to fill both ports; two chains made the
// Q4_K kernel 10-15% faster at 8-32 rows, four no faster than two (Emerald Rapids, A/B in one
// process).
template <int Count>
inline __m512i dot_codes(__m512i init, const __m512i* codes, const int8_t* x) {
  __m512i even = init, odd = _mm512_setzero_si512();
  for (int i = 0; i < Count; i += 2) {
    even = dot_add_broadcast(even, codes[i], x + 4 * i);
    odd = dot_add_broadcast(odd, codes[i + 1], x + 4 * i + 4);
  }
  return _mm512_add_epi32(even, odd);
}
#endif

#if KVSERVE_VEC
// kernel(R) for a row block of `rows` (<= kRowBlock) rows, R as a compile-time constant.
template <typename Kernel>
void with_row_count(int rows, Kernel kernel) {
  switch (rows) {
#define KVSERVE_ROWS_CASE(R) \
  case R: kernel(std::integral_constant<int, R>()); break;
    KVSERVE_ROWS_CASE(1) KVSERVE_ROWS_CASE(2) KVSERVE_ROWS_CASE(3) KVSERVE_ROWS_CASE(4)
    KVSERVE_ROWS_CASE(5) KVSERVE_ROWS_CASE(6) KVSERVE_ROWS_CASE(7) KVSERVE_ROWS_CASE(8)
#if KVSERVE_Q8_ZMM
    KVSERVE_ROWS_CASE(9) KVSERVE_ROWS_CASE(10) KVSERVE_ROWS_CASE(11) KVSERVE_ROWS_CASE(12)
#endif
#undef KVSERVE_ROWS_CASE
    default: TORCH_CHECK(false, "q8 dot: bad row block ", rows);
  }
}

// A panel's 16 outputs for `rows` (<= 8) rows from m0, both ymm halves.
template <typename Kernel>
void panel_rows(int rows, Kernel kernel) {
  for (int half = 0; half < 2; ++half)
    with_row_count(rows, [&](auto r) { kernel(r, half); });
}

#endif  // KVSERVE_VEC

// A share of a call's work: rows [m_begin, m_end) of x against panels [p_begin, p_end) of W.
struct PanelSpan {
  int64_t m_begin, m_end, p_begin, p_end;
};

// Rows of x (a multiple of `pass`, at least one pass) whose codes, `cols` bytes a row, fill a
// quarter of this core's L2 (the panel being read, the outputs and the prefetched stream share
// the rest). Why: every panel reads all of a span's rows; at a 512-token prefill that is 1 MB
// (K = 2048) to 4 MB of codes a panel, streamed from L3 sixteen outputs at a time, and the
// kernels ran at ~560 G multiply-adds a second against ~700 at 16 rows (Zen 5, Q4_K). The size
// is the cache's (sysconf), not a measured constant; 512 KB (the smallest L2 we run on) when the
// system does not say.
inline int64_t cached_rows(int64_t cols, int64_t pass) {
  static const int64_t l2_bytes = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{512} << 10;
  }();
  return std::max<int64_t>(1, l2_bytes / 4 / std::max<int64_t>(cols, 1) / pass) * pass;
}

// y[m, n] over a span on the calling thread: the rows in cached blocks (cached_rows), per block
// every panel, per panel the block's rows in passes of equal size (each pays the panel's
// unpacking), outputs stored (bias, bf16) as they come. `tile(rows, m0, panel, out)` fills
// out[m][16] for a row block of at most max_pass (<= kRowBlock) rows; the scalar build calls
// `scalar(m, panel, n)` per output.
template <typename Tile, typename Scalar>
void run_span(const QuantizedRows& xq, const PanelSpan& span, int64_t out_features,
              int64_t panel_bytes, const uint8_t* packed, const OutputRows& y, Tile tile,
              Scalar scalar, int64_t max_pass = kRowBlock) {
  const int64_t pass = rows_per_pass(span.m_end - span.m_begin, max_pass);
  const int64_t cached = cached_rows(xq.cols, pass);
  float out[kRowBlock * 16];
  for (int64_t first = span.m_begin; first < span.m_end; first += cached) {
    const int64_t last = std::min(span.m_end, first + cached);
    for (int64_t p = span.p_begin; p < span.p_end; ++p) {
      const uint8_t* panel = packed + p * panel_bytes;
      const int64_t count = std::min<int64_t>(16, out_features - p * 16);
      for (int64_t m0 = first; m0 < last; m0 += pass) {
        const int block_rows = static_cast<int>(std::min<int64_t>(pass, last - m0));
#if KVSERVE_VEC
        tile(block_rows, m0, panel, out);
#else
        for (int m = 0; m < block_rows; ++m)
          for (int64_t n = 0; n < count; ++n) out[m * 16 + n] = scalar(m0 + m, panel, n);
#endif
        for (int m = 0; m < block_rows; ++m) y.store(m0 + m, p * 16, out + m * 16, count);
      }
    }
  }
}

// A weight format's kernel over a span of a projection (packed: its panels, uint8 [panels, ...])
// on the calling thread: the callers own the parallel region (with_quantized_rows for one
// projection, moe.cpp for every active expert's at once).
using PanelKernel = void (*)(const QuantizedRows& xq, const PanelSpan& span,
                             const at::Tensor& packed, int64_t out_features,
                             const OutputRows& y);

// Quantizes x's groups [begin, end) (see quantize_groups); run by every thread of the kernel's
// parallel region on its share, before the panels.
using QuantizeRange = std::function<void(int64_t, int64_t)>;

// y[m, n] for every row and output, in one parallel region: the threads first quantize x (each
// a share of its groups), meet at a barrier, then each takes one contiguous run of panels (one
// stream of blocks). Why one region: x's quantization and y's conversion ran serially around
// the kernel, the other core spinning; at a 9-token verification that was ~6% of the step's
// samples (perf, Zen 4).
inline void run_panels(const QuantizedRows& xq, int64_t rows, const at::Tensor& packed,
                       int64_t out_features, const OutputRows& y, const QuantizeRange& quantize,
                       PanelKernel kernel) {
  const int64_t panels = (out_features + 15) / 16;
  const int64_t units = xq.units(rows);
  at::internal::lazy_init_num_threads();
  // at least 4 panels a thread (at::parallel_for's grain before)
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (panels + 3) / 4));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    quantize(units * thread / team, units * (thread + 1) / team);
#pragma omp barrier
    const int64_t chunk = (panels + team - 1) / team;
    const int64_t begin = thread * chunk, end = std::min(panels, begin + chunk);
    if (begin < end) kernel(xq, PanelSpan{0, rows, begin, end}, packed, out_features, y);
  }
}

// quantize_groups over src (element type T) into xq, as a QuantizeRange; xq is captured by
// reference: the range runs on the region's other threads, whose thread_local copy is not it.
template <typename T>
QuantizeRange quantize_range(QuantizedRows& xq, const at::Tensor& src, CodeOrder order) {
  const T* data = src.data_ptr<T>();
  const int64_t ld = src.stride(0);
  return [&xq, data, ld, order](int64_t begin, int64_t end) {
    quantize_groups(xq, data, ld, order, begin, end);
  };
}

// x (float32 or bfloat16, [M, K]) quantized as it is (rows may be strided), y (+ bias) in x's
// dtype. Per call only the output is allocated: at one row, through the decode stack's 120
// projections a step, torch conversions and per-call buffers cost more than the kernels saved
// (w4a8's single-stream TPOT read 0.80-0.88x int4's with them).
inline at::Tensor with_quantized_rows(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                               int64_t out_features, CodeOrder order, PanelKernel run,
                               const at::Tensor& packed, int64_t step_groups = 1) {
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const at::Tensor src = x.stride(1) == 1 ? x : x.contiguous();
  thread_local QuantizedRows buffers;
  QuantizedRows& xq = buffers;
  size_rows(xq, rows, x.size(1), step_groups);
  at::Tensor float_bias;
  OutputRows y;
  y.ld = out_features;
  if (bias) {
    float_bias = bias->to(at::kFloat).contiguous();
    y.bias = float_bias.data_ptr<float>();
  }
  QuantizeRange quantize;
  if (x.scalar_type() == at::kFloat) {
    y.f32 = out.data_ptr<float>();
    quantize = quantize_range<float>(xq, src, order);
  } else {
    y.bf16 = reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>());
    quantize = quantize_range<BFloat16>(xq, src, order);
  }
  run_panels(xq, rows, packed, out_features, y, quantize, run);
  return out;
}

inline void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, name,
              ": x must be [M, K] with K divisible by 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16");
}

}  // namespace q8
}  // namespace kvserve
