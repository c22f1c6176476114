// Integer-dot GEMVs for few rows: activations quantized to int8 per group of 32 (llama.cpp's
// Q8 activations), dotted with int4 (Q4_1) or int8 (Q8_0) weights by integer multiply-adds.
//
// Why: on AVX2 the float kernels (int4_gemm.cpp, int8_gemm.cpp) widen each weight to float and
// spend one FMA per weight and row: from a few rows on (decode batches, prefill) they are bound
// by those instructions (Zen 3: gate_up at 32 rows 1.2 ms here against 0.49 ms; at one row both
// run at the memory's pace, ~15 GB/s of a 21 GB/s roof, docs/performance.md).
// `vpmaddubsw` multiplies 32 unsigned bytes by 32 signed bytes and adds pairs into int16, so the
// codes are used as they are (a mask, a shift) and one instruction does 32 multiply-adds; with
// AVX512-VNNI `vpdpbusd` also does the add into int32, on a whole 16-output panel per zmm (64
// multiply-adds an instruction, twice `vdpbf16ps`'s). The cost is lossy: x is rounded to 127
// steps of its group's absmax (x' = d * xq), as llama.cpp does on every CPU; the dot products are
// then exact, so y = W x' exactly up to float rounding of the per-group partial sums.
//
// Weights stay in the float kernels' panel layouts (reference.py::pack_int4 / pack_int8), so one
// packed copy serves both kernels. x's codes are stored per group in the byte order the layout's
// 32-bit lanes need:
// - int4: a 32-byte half of a 64-byte chunk is 8 output rows, one 32-bit lane each, holding the
//   row's nibbles for k = 8c..8c+7 as two 16-bit words (even k, odd k). `lane & 0x0F0F0F0F` gives
//   bytes (k0, k4, k1, k5), `(lane >> 4) & 0x0F0F0F0F` gives (k2, k6, k3, k7): x's codes for a
//   chunk are stored in that order, so each is one broadcast 32-bit value. The per-group metadata
//   here is (scale, low), w = q * scale + low, in float16 (320-byte blocks; GGUF's Q4_0/Q4_1
//   store d and m in float16, so they fit exactly) or float32 (384): float16 saves a sixth of
//   the bytes a decode step reads. y = sum_g scale d sum(q xq) + low d sum(xq), q in 0..15: per
//   group the int16 sums stay below 8 * 2 * 15 * 127 = 30,480, no saturation.
// - int8: chunk c holds k = 4c..4c+3 of 16 rows, one lane each; x's codes in natural order. The
//   signed x signed product goes through |w| and sign(x, w) (vpmaddubsw wants one operand
//   unsigned); pairs reach 2 * 127 * 127, so each chunk widens to int32 at once. On zmm
//   (no vpsignb) through w + 128 and a correction by 128 sum(xq), as exact.
#include "q8_dot_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include <omp.h>

#include "panel_layouts.h"
#include "vec.h"

namespace kvserve {
namespace {

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
// and d * sum(codes) (the exact sum of x' = d * xq, for the int4 zero-point term).
struct QuantizedRows {
  std::vector<int8_t> codes;  // [rows, K]
  std::vector<float> step;    // [rows, groups]
  std::vector<float> sum;     // [rows, groups]
  std::vector<int32_t> code_sum;  // [rows, groups]: sum of the group's codes
  int64_t cols = 0, groups = 0;

  const int8_t* group_codes(int64_t m, int64_t g) const { return codes.data() + m * cols + g * 32; }
  float step_at(int64_t m, int64_t g) const { return step[m * groups + g]; }
  float sum_at(int64_t m, int64_t g) const { return sum[m * groups + g]; }
  int32_t code_sum_at(int64_t m, int64_t g) const { return code_sum[m * groups + g]; }
};

// Position in the stored group of the code of x[k] (k within the group).
inline int stored_position(int k, CodeOrder order) {
  if (order == CodeOrder::kNatural) return k;
  // chunk of 8: stored (k0, k4, k1, k5, k2, k6, k3, k7)
  static constexpr int kInChunk[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  return (k & ~7) + kInChunk[k & 7];
}

// One group of 32: its codes into dst (stored order) and its step; returns the codes' sum.
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

template <typename T>
int quantize_group(const T* src, int8_t* dst, CodeOrder order, float& step) {
  __m256 values[4];
  __m256 absmax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    values[i] = load8_float(src + 8 * i);
    absmax = _mm256_max_ps(absmax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), values[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(absmax), _mm256_extractf128_ps(absmax, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
  step = _mm_cvtss_f32(half) / 127.f;
  const __m256 inverse = _mm256_set1_ps(step > 0.f ? 1.f / step : 0.f);
  __m256i codes[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values[i], inverse));
    sum = _mm256_add_epi32(sum, codes[i]);
  }
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
  __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4E));
  total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xB1));
  return _mm_cvtsi128_si32(total);
}
#else
template <typename T>
int quantize_group(const T* src, int8_t* dst, CodeOrder order, float& step) {
  float absmax = 0.f;
  for (int k = 0; k < 32; ++k) absmax = std::max(absmax, std::fabs(static_cast<float>(src[k])));
  step = absmax / 127.f;
  const float inverse = step > 0.f ? 1.f / step : 0.f;
  int code_sum = 0;
  for (int k = 0; k < 32; ++k) {
    const int code = static_cast<int>(std::nearbyint(static_cast<float>(src[k]) * inverse));
    dst[stored_position(k, order)] = static_cast<int8_t>(code);
    code_sum += code;
  }
  return code_sum;
}
#endif

// Sizes `q` for rows x cols (its buffers only grow: the caller keeps one, no allocation a call).
void size_rows(QuantizedRows& q, int64_t rows, int64_t cols) {
  q.cols = cols;
  q.groups = cols / 32;
  q.codes.resize(rows * cols);
  q.step.resize(rows * q.groups);
  q.sum.resize(rows * q.groups);
  q.code_sum.resize(rows * q.groups);
}

// Groups [begin, end) of x, counted over rows then groups, into `q` (sized by size_rows): each
// group's codes and step depend on that group alone, so threads may take disjoint ranges.
template <typename T>
void quantize_groups(QuantizedRows& q, const T* x, int64_t ldx, CodeOrder order, int64_t begin,
                     int64_t end) {
  if (begin >= end) return;
  int64_t m = begin / q.groups, g = begin % q.groups;  // one division, not one a group
  float* steps = q.step.data();
  float* sums = q.sum.data();
  int32_t* code_sums = q.code_sum.data();
  for (int64_t i = begin; i < end; ++i) {
    float step;
    const int code_sum = quantize_group(x + m * ldx + g * 32, q.codes.data() + m * q.cols + g * 32,
                                        order, step);
    steps[i] = step;
    sums[i] = step * static_cast<float>(code_sum);
    code_sums[i] = code_sum;
    if (++g == q.groups) g = 0, ++m;
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

// Quantizes x's groups [begin, end) (see quantize_groups); run by every thread of the kernel's
// parallel region on its share, before the panels.
using QuantizeRange = std::function<void(int64_t, int64_t)>;

inline float widen(float v) { return v; }
inline float widen(Half v) { return static_cast<float>(v); }

// ---- portable loops over the same layouts and codes (the scalar build)

template <typename S>
float int4_dot_scalar(const QuantizedRows& xq, int64_t m, const uint8_t* panel, int64_t n) {
  float acc = 0.f;
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + g * Int4Block<S>::kBytes;
    const int8_t* codes = xq.group_codes(m, g);
    int dot = 0;
    for (int k = 0; k < 32; ++k)
      dot += int4_code_at(block, n, k) * codes[stored_position(k, CodeOrder::kInt4Lanes)];
    const float scale = widen(Int4Block<S>::scales(block)[n]);
    const float low = widen(Int4Block<S>::zeros(block)[n]);  // the second array holds lows here
    acc += scale * xq.step_at(m, g) * static_cast<float>(dot) + low * xq.sum_at(m, g);
  }
  return acc;
}

float int8_dot_scalar(const QuantizedRows& xq, int64_t m, const uint8_t* panel, int64_t n) {
  float acc = 0.f;
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + g * kInt8BlockBytes;
    const int8_t* codes = xq.group_codes(m, g);
    int dot = 0;
    for (int k = 0; k < 32; ++k) dot += int8_code_at(block, n, k) * codes[k];
    acc += int8_block_scales(block)[n] * xq.step_at(m, g) * static_cast<float>(dot);
  }
  return acc;
}

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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// acc += sum over each 32-bit lane's 4 byte products, u8 x s8, into int32
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#endif

// One row's group dot products for 8 output rows (int32 lanes): the unpacked int4 codes against
// the row's 32 int8 codes (stored in the lanes' order). Without VNNI the int16 pair sums stay
// below 8 * 2 * 15 * 127 = 30,480 (no saturation) and widen once at the end.
inline __m256i int4_group_dot(const __m256i codes[8], const int8_t* x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 8; ++i) acc = dot_add(acc, codes[i], broadcast_code_word(x + 4 * i));
  return acc;
#else
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 8; i += 2) {
    acc = _mm256_add_epi16(acc, _mm256_add_epi16(
        _mm256_maddubs_epi16(codes[i], broadcast_code_word(x + 4 * i)),
        _mm256_maddubs_epi16(codes[i + 1], broadcast_code_word(x + 4 * i + 4))));
  }
  return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
}

// The same for signed Q8_0 codes: |w| times x with w's sign (vpmaddubsw wants one operand
// unsigned); pair sums reach 2 * 127 * 127, so each chunk widens to int32 at once.
inline __m256i int8_group_dot(const __m256i codes[8], const __m256i magnitudes[8],
                              const int8_t* x) {
  __m256i acc = _mm256_setzero_si256();
  for (int chunk = 0; chunk < 8; ++chunk) {
    const __m256i signed_x = _mm256_sign_epi8(broadcast_code_word(x + 4 * chunk), codes[chunk]);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    acc = dot_add(acc, magnitudes[chunk], signed_x);
#else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes[chunk], signed_x),
                                                  _mm256_set1_epi16(1)));
#endif
  }
  return acc;
}

// out[m][8 lanes] for R rows over one half (8 output rows) of an int4 panel. Per group the 8
// unpacked code vectors stay in registers while each row's dot product runs over them; rows are
// the outer loop so a row needs one accumulator, not R of them (with rows inner, GCC kept
// 8 rows x 8 products live and spilled them to the stack: 4x slower at 8-32 rows).
template <int R, typename S>
void int4_half_panel(const QuantizedRows& xq, int64_t m0, const uint8_t* panel, int half,
                     float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + g * Int4Block<S>::kBytes;
    if (half == 0) int4_prefetch_block<S>(block + kInt4PrefetchBlocks * Int4Block<S>::kBytes);
    __m256i codes[8];  // chunk c: 2c = bytes (k0, k4, k1, k5), 2c + 1 = (k2, k6, k3, k7)
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m256i words = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(block + chunk * kInt4ChunkBytes + 32 * half));
      codes[2 * chunk] = _mm256_and_si256(words, low4);
      codes[2 * chunk + 1] = _mm256_and_si256(_mm256_srli_epi16(words, 4), low4);
    }
    const __m256 scale = load8(Int4Block<S>::scales(block) + 8 * half);
    const __m256 low = load8(Int4Block<S>::zeros(block) + 8 * half);
    for (int m = 0; m < R; ++m) {
      const int8_t* x = xq.group_codes(m0 + m, g);
      const __m256i dot = int4_group_dot(codes, x);
      const __m256 step_scale = _mm256_mul_ps(scale, _mm256_set1_ps(xq.step_at(m0 + m, g)));
      total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), step_scale, total[m]);
      total[m] = _mm256_fmadd_ps(low, _mm256_set1_ps(xq.sum_at(m0 + m, g)), total[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm256_storeu_ps(out + m * 16 + 8 * half, total[m]);
}

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

// out[m][16] for R rows over a whole int4 panel: int4_half_panel's steps, both halves in one zmm
// (lane n = output row n), in the same order per lane, so the results are the ymm kernel's.
template <int R, typename S>
void int4_full_panel(const QuantizedRows& xq, int64_t m0, const uint8_t* panel, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + g * Int4Block<S>::kBytes;
    int4_prefetch_block<S>(block + kInt4PrefetchBlocks * Int4Block<S>::kBytes);
    __m512i codes[8];  // chunk c: 2c = bytes (k0, k4, k1, k5), 2c + 1 = (k2, k6, k3, k7)
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m512i words = _mm512_loadu_si512(block + chunk * kInt4ChunkBytes);
      codes[2 * chunk] = _mm512_and_si512(words, low4);
      codes[2 * chunk + 1] = _mm512_and_si512(_mm512_srli_epi16(words, 4), low4);
    }
    const __m512 scale = load16(Int4Block<S>::scales(block));
    const __m512 low = load16(Int4Block<S>::zeros(block));
    for (int m = 0; m < R; ++m) {
      const int8_t* x = xq.group_codes(m0 + m, g);
      __m512i dot = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) dot = dot_add_broadcast(dot, codes[i], x + 4 * i);
      const __m512 step_scale = _mm512_mul_ps(scale, _mm512_set1_ps(xq.step_at(m0 + m, g)));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), step_scale, total[m]);
      total[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(xq.sum_at(m0 + m, g)), total[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * 16, total[m]);
}

// out[m][16] for R rows over a whole int8 (Q8_0) panel. vpdpbusd wants one operand unsigned and
// AVX-512 has no vpsignb, so the codes go in as w + 128 (w ^ 0x80, 0..255) against x's signed
// codes: sum((w + 128) x) - 128 sum(x) is the exact integer dot (|sum| < 2^31: 8 x 4 x 255 x 127),
// then int8_half_panel's float steps, so the results are the ymm kernel's.
template <int R>
void int8_full_panel(const QuantizedRows& xq, int64_t m0, const uint8_t* panel, float* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + g * kInt8BlockBytes;
    int8_prefetch_ahead(block);
    __m512i biased[8];  // chunk c: k = 4c..4c+3 of the 16 rows, one lane each, + 128
    for (int chunk = 0; chunk < 8; ++chunk)
      biased[chunk] = _mm512_xor_si512(_mm512_loadu_si512(block + chunk * 64), flip);
    const __m512 scale = _mm512_loadu_ps(int8_block_scales(block));
    for (int m = 0; m < R; ++m) {
      const int8_t* x = xq.group_codes(m0 + m, g);
      __m512i dot = _mm512_set1_epi32(-128 * xq.code_sum_at(m0 + m, g));
      for (int chunk = 0; chunk < 8; ++chunk)
        dot = dot_add_broadcast(dot, biased[chunk], x + 4 * chunk);
      const __m512 step_scale = _mm512_mul_ps(scale, _mm512_set1_ps(xq.step_at(m0 + m, g)));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), step_scale, total[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * 16, total[m]);
}
#endif  // KVSERVE_Q8_ZMM

// out[m][8 lanes] for R rows over one half of an int8 (Q8_0) panel. Per group the 8 chunks'
// codes and magnitudes go to an L1 scratch once; each row then reads them back (loads are cheap,
// registers are not: 16 on AVX2).
template <int R>
void int8_half_panel(const QuantizedRows& xq, int64_t m0, const uint8_t* panel, int half,
                     float* out) {
  __m256 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm256_setzero_ps();
  alignas(32) __m256i codes[8], magnitudes[8];
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + g * kInt8BlockBytes;
    if (half == 0) int8_prefetch_ahead(block);
    for (int chunk = 0; chunk < 8; ++chunk) {
      codes[chunk] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(block + chunk * 64 + 32 * half));
      magnitudes[chunk] = _mm256_abs_epi8(codes[chunk]);
    }
    const __m256 scale = _mm256_loadu_ps(int8_block_scales(block) + 8 * half);
    for (int m = 0; m < R; ++m) {
      const __m256i dot = int8_group_dot(codes, magnitudes, xq.group_codes(m0 + m, g));
      const __m256 step_scale = _mm256_mul_ps(scale, _mm256_set1_ps(xq.step_at(m0 + m, g)));
      total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), step_scale, total[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm256_storeu_ps(out + m * 16 + 8 * half, total[m]);
}

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

// y[m, n] for every row and output, in one parallel region: the threads first quantize x (each
// a share of its groups), meet at a barrier, then each takes one contiguous run of panels (one
// stream of blocks) and stores its outputs (bias, bf16) as they come. Why one region: x's
// quantization and y's conversion ran serially around the kernel, the other core spinning;
// at a 9-token verification that was ~6% of the step's samples (perf, Zen 4). `tile(rows, m0,
// panel, out)` fills out[m][16] for a row block of at most `max_rows` rows (passes of equal
// size: each pays the panel's unpacking).
template <typename Tile, typename Scalar>
void run_panels(const QuantizedRows& xq, int64_t rows, int64_t out_features, int64_t panel_bytes,
                const uint8_t* packed, const OutputRows& y, const QuantizeRange& quantize,
                int64_t max_rows, Tile tile, Scalar scalar) {
  const int64_t panels = (out_features + 15) / 16;
  const int64_t pass = rows_per_pass(rows, max_rows);
  const int64_t groups = rows * xq.groups;
  at::internal::lazy_init_num_threads();
  // at least 4 panels a thread (at::parallel_for's grain before)
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (panels + 3) / 4));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    quantize(groups * thread / team, groups * (thread + 1) / team);
#pragma omp barrier
    const int64_t chunk = (panels + team - 1) / team;
    const int64_t begin = thread * chunk, end = std::min(panels, begin + chunk);
    float out[kRowBlock * 16];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = packed + p * panel_bytes;
      const int64_t count = std::min<int64_t>(16, out_features - p * 16);
      for (int64_t m0 = 0; m0 < rows; m0 += pass) {
        const int block_rows = static_cast<int>(std::min<int64_t>(pass, rows - m0));
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

template <typename S>
void int4_q8(const QuantizedRows& xq, int64_t rows, const uint8_t* packed, int64_t out_features,
             const OutputRows& y, const QuantizeRange& quantize) {
  const int64_t panel_bytes = xq.groups * Int4Block<S>::kBytes;
  auto tile = [&](int block_rows, int64_t m0, const uint8_t* panel, float* out) {
#if KVSERVE_Q8_ZMM
    with_row_count(block_rows, [&](auto r) {
      int4_full_panel<decltype(r)::value, S>(xq, m0, panel, out);
    });
#elif KVSERVE_VEC
    panel_rows(block_rows, [&](auto r, int half) {
      int4_half_panel<decltype(r)::value, S>(xq, m0, panel, half, out);
    });
#endif
  };
  auto scalar = [&](int64_t m, const uint8_t* panel, int64_t n) {
    return int4_dot_scalar<S>(xq, m, panel, n);
  };
  run_panels(xq, rows, out_features, panel_bytes, packed, y, quantize, kRowBlock, tile, scalar);
}

void int8_q8(const QuantizedRows& xq, int64_t rows, const uint8_t* packed, int64_t out_features,
             const OutputRows& y, const QuantizeRange& quantize) {
  auto tile = [&](int block_rows, int64_t m0, const uint8_t* panel, float* out) {
#if KVSERVE_Q8_ZMM
    with_row_count(block_rows, [&](auto r) {
      int8_full_panel<decltype(r)::value>(xq, m0, panel, out);
    });
#elif KVSERVE_VEC
    panel_rows(block_rows, [&](auto r, int half) {
      int8_half_panel<decltype(r)::value>(xq, m0, panel, half, out);
    });
#endif
  };
  auto scalar = [&](int64_t m, const uint8_t* panel, int64_t n) {
    return int8_dot_scalar(xq, m, panel, n);
  };
  run_panels(xq, rows, out_features, xq.groups * kInt8BlockBytes, packed, y, quantize, kRowBlock,
             tile, scalar);
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
using PanelKernel = void (*)(const QuantizedRows&, int64_t, const at::Tensor&, int64_t,
                             const OutputRows&, const QuantizeRange&);

at::Tensor with_quantized_rows(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                               int64_t out_features, CodeOrder order, PanelKernel run,
                               const at::Tensor& packed) {
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const at::Tensor src = x.stride(1) == 1 ? x : x.contiguous();
  thread_local QuantizedRows buffers;
  QuantizedRows& xq = buffers;
  size_rows(xq, rows, x.size(1));
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
  run(xq, rows, packed, out_features, y, quantize);
  return out;
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, name,
              ": x must be [M, K] with K divisible by 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16");
}

}  // namespace

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_x(x, "int4_linear_q8");
  const int64_t groups = x.size(1) / 32;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (out_features + 15) / 16 && packed.size(1) == groups &&
                  (packed.size(2) == Int4Block<Half>::kBytes ||
                   packed.size(2) == Int4Block<float>::kBytes),
              "int4_linear_q8: packed must be uint8 [ceil(N / 16), K / 32, 320 or 384]");
  TORCH_CHECK(!bias || bias->numel() == out_features, "int4_linear_q8: bias must be [N]");
  auto run = [](const QuantizedRows& xq, int64_t rows, const at::Tensor& w, int64_t n,
                const OutputRows& y, const QuantizeRange& quantize) {
    const uint8_t* data = w.data_ptr<uint8_t>();
    w.size(2) == Int4Block<Half>::kBytes ? int4_q8<Half>(xq, rows, data, n, y, quantize)
                                         : int4_q8<float>(xq, rows, data, n, y, quantize);
  };
  return with_quantized_rows(x, bias, out_features, CodeOrder::kInt4Lanes, run, packed);
}

at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_x(x, "int8_linear_q8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (out_features + 15) / 16 &&
                  packed.size(1) == x.size(1) / 32 && packed.size(2) == kInt8BlockBytes,
              "int8_linear_q8: packed must be uint8 [ceil(N / 16), K / 32, 576]");
  TORCH_CHECK(!bias || bias->numel() == out_features, "int8_linear_q8: bias must be [N]");
  auto run = [](const QuantizedRows& xq, int64_t rows, const at::Tensor& w, int64_t n,
                const OutputRows& y, const QuantizeRange& quantize) {
    int8_q8(xq, rows, w.data_ptr<uint8_t>(), n, y, quantize);
  };
  return with_quantized_rows(x, bias, out_features, CodeOrder::kNatural, run, packed);
}

bool q8_dot_wide() { return KVSERVE_Q8_ZMM; }

}  // namespace kvserve
