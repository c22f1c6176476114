// Linear layers over GGUF's block formats as the file stores them (gguf_layouts.h).
//
// Why: dequantizing a Q4_K_M model to float and re-quantizing it to our int4/int8 panels served
// it with other numbers (and read its 6-bit tensors as 8-bit). Here the file's codes and scales
// are the weights:
// - gguf_linear_q8: int4_linear_q8's integer-dot kernel (q8_dot_gemm.cpp, q8_rows.h) with the
//   formats' codes: x rounded per group of 32 to int8 (the same codes and steps), the 4 low bits
//   unpacked as there, the fifth and sixth bits merged from their planes (a shift, an and, an
//   or), then vpmaddubsw (AVX2, ymm halves of a panel) or vpdpbusd (AVX512-VNNI, a whole panel
//   per zmm). Per (row, group) the int32 dot goes to float with the group's scale (Q4_K: d * sc)
//   and low (-(dmin * m), times the exact sum of x'); Q6_K's sub-blocks of 16 each get their
//   own scale and their -32 offset through x's per-16 code sums (computed with the codes).
// - gguf_linear_dequant: float activations and the exact weights, slabs of rows dequantized into
//   a scratch buffer in x's dtype and multiplied by at::linear (prefill-sized batches, the
//   exact mode).
// Q4_0, Q4_1 and Q8_0 are int4_linear_q8's and int8_linear_q8's own layouts and kernels. MXFP4's
// codes go through a 16-entry byte table (one vpshufb a code vector) to e2m1 value + 12, then
// the affine path (scale d, low -12 d): 2x fewer bytes than its values as int8 (5760 x 2880 at
// one row: 0.34 ms against 0.58, Emerald Rapids).
#include "gguf_gemm.h"

#include <algorithm>

#include "gguf_layouts.h"
#include "q8_dot_gemm.h"
#include "q8_rows.h"

namespace kvserve {
namespace {

using namespace q8;

// Bytes prefetched ahead of the group being read: int4_linear_q8's distance (~10 KB, measured
// there), which each call's new streams need before the hardware prefetcher catches them.
constexpr int64_t kPrefetchBytes = kInt4PrefetchBlocks * Int4Block<Half>::kBytes;

#if KVSERVE_VEC
// ---- one register width each: the same kernel source for ymm halves and whole-panel zmm

// Half a panel per ymm (AVX2): 8 output rows, one 32-bit lane each; the 32 bytes at 32 * half of
// each 64-byte vector and the metadata entries from 8 * half.
struct YmmHalf {
  using I = __m256i;
  using F = __m256;
  int half;

  bool leads() const { return half == 0; }
  I bytes(const uint8_t* p) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
  }
  F halves(const uint8_t* p) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
  }
  F u8s(const uint8_t* p) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  }
  F i8s(const uint8_t* p) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
  F floats(const uint8_t* p) const {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * half);
  }
  void store(float* out, F v) const { _mm256_storeu_ps(out + 8 * half, v); }
  // each byte (a 4-bit code) replaced by table[byte] (16 entries)
  static I lookup(I v, const uint8_t* table) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), v);
  }

  static I set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I set32(int v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I shift(I v, int bits) {  // 16-bit lanes, left for bits > 0
    return bits > 0 ? _mm256_slli_epi16(v, bits) : bits < 0 ? _mm256_srli_epi16(v, -bits) : v;
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }

  // init + the dot products of Count code vectors with x's codes (4 per vector, in order) in
  // int32 lanes. vpmaddubsw's int16 pair sums reach 2 * (2^Bits - 1) * 127: runs of as many as
  // stay within 32,767 (8, 4, 2 vectors for 4, 5, 6 bits) add in int16 before one widening.
  template <int Bits, int Count> static I dot(I init, const I* codes, const int8_t* x) {
    constexpr int kRun = 32767 / (2 * ((1 << Bits) - 1) * 127);
    I acc = init;
    for (int i = 0; i < Count; i += kRun) {
      I run = _mm256_maddubs_epi16(codes[i], broadcast_code_word(x + 4 * i));
      for (int j = i + 1; j < std::min(Count, i + kRun); ++j)
        run = _mm256_add_epi16(run, _mm256_maddubs_epi16(codes[j], broadcast_code_word(x + 4 * j)));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(run, _mm256_set1_epi16(1)));
    }
    return acc;
  }
};
#endif

#if KVSERVE_Q8_ZMM
// A whole panel per zmm (AVX512-VNNI): lane n = output row n.
struct ZmmPanel {
  using I = __m512i;
  using F = __m512;

  bool leads() const { return true; }
  I bytes(const uint8_t* p) const { return _mm512_loadu_si512(p); }
  F halves(const uint8_t* p) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  F u8s(const uint8_t* p) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  }
  F i8s(const uint8_t* p) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
  F floats(const uint8_t* p) const { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
  void store(float* out, F v) const { _mm512_storeu_ps(out, v); }
  static void store_lanes(float* out, F v) { _mm512_storeu_ps(out, v); }
  static I lookup(I v, const uint8_t* table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), v);
  }

  static I set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I set32(int v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }  // with and_: one vpternlog
  static I shift(I v, int bits) {
    return bits > 0 ? _mm512_slli_epi16(v, bits) : bits < 0 ? _mm512_srli_epi16(v, -bits) : v;
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }

  // vpdpbusd accumulates in int32: no saturation whatever the bits
  template <int Bits, int Count> static I dot(I init, const I* codes, const int8_t* x) {
    return dot_codes<Count>(init, codes, x);
  }
};
#endif

// ---- per (row, group) terms of the formats, for a width W

#if KVSERVE_VEC
// w = q * scale + low on the whole group (Q5_0, Q5_1, Q4_K, Q5_K): as int4_linear_q8,
// scale * d * sum(q xq) + low * d * sum(xq).
template <typename W, int Bits> struct AffineGroup {
  typename W::F scale, low;

  void add_row(typename W::F& total, const typename W::I codes[8], const QuantizedRows& xq,
               int64_t m, int64_t g) const {
    const auto dot = W::template dot<Bits, 8>(W::set32(0), codes, xq.group_codes(m, g));
    total = W::fma(W::cvt(dot), W::mul(scale, W::set1(xq.step_at(m, g))), total);
    total = W::fma(low, W::set1(xq.sum_at(m, g)), total);
  }
  // the terms' 16 lanes (scale, low) into a[16], b[16]
  void lanes(float* a, float* b) const { W::store_lanes(a, scale), W::store_lanes(b, low); }
};

// Q6_K: w = scale_j * (q - 32) on sub-block j (16 values) of the group: per sub-block the dot
// starts at -32 sum(xq) over its 16 codes, so it is the exact integer sum((q - 32) xq).
template <typename W> struct Q6Group {
  typename W::F first, second;  // the two sub-blocks' d * scale

  void add_row(typename W::F& total, const typename W::I codes[8], const QuantizedRows& xq,
               int64_t m, int64_t g) const {
    const int8_t* x = xq.group_codes(m, g);
    const int32_t head = xq.half_sum_at(m, g), tail = xq.code_sum_at(m, g) - head;
    const auto a = W::template dot<6, 4>(W::set32(-32 * head), codes, x);
    const auto b = W::template dot<6, 4>(W::set32(-32 * tail), codes + 4, x + 16);
    const auto sum = W::fma(W::cvt(b), second, W::mul(W::cvt(a), first));
    total = W::fma(sum, W::set1(xq.step_at(m, g)), total);
  }
  // the terms' 16 lanes (the sub-blocks' scales) into a[16], b[16]
  void lanes(float* a, float* b) const { W::store_lanes(a, first), W::store_lanes(b, second); }
};
#endif

// The scalar build's group term of row n: affine formats' (scale, low), dots = the integer
// sums over k < 16 and k >= 16.
inline float affine_scalar(float scale, float low, const int dots[2], const QuantizedRows& xq,
                           int64_t m, int64_t g) {
  return scale * xq.step_at(m, g) * static_cast<float>(dots[0] + dots[1]) + low * xq.sum_at(m, g);
}

// ---- the formats: group(w, block, s) gives the vector kernels' group terms for 16 (or 8)
// rows, scalar(block, s, n, dots, xq, m, g) the scalar loop's for row n.

struct Q5_0Kernel {
  using Layout = Q5_0Layout;  // w = d * (q - 16): scale d, low -16 d
#if KVSERVE_VEC
  template <typename W> static AffineGroup<W, 5> group(const W& w, const uint8_t* block, int) {
    const auto d = w.halves(Layout::d(block));
    return {d, W::mul(d, W::set1(-16.f))};
  }
#endif
  static float scalar(const uint8_t* block, int, int64_t n, const int dots[2],
                      const QuantizedRows& xq, int64_t m, int64_t g) {
    const float d = half_at(Layout::d(block), n);
    return affine_scalar(d, -16.f * d, dots, xq, m, g);
  }
};

struct Q5_1Kernel {
  using Layout = Q5_1Layout;  // w = d * q + m
#if KVSERVE_VEC
  template <typename W> static AffineGroup<W, 5> group(const W& w, const uint8_t* block, int) {
    return {w.halves(Layout::d(block)), w.halves(Layout::m(block))};
  }
#endif
  static float scalar(const uint8_t* block, int, int64_t n, const int dots[2],
                      const QuantizedRows& xq, int64_t m, int64_t g) {
    return affine_scalar(half_at(Layout::d(block), n), half_at(Layout::m(block), n), dots, xq,
                         m, g);
  }
};

template <int HighBits> struct KKernel {
  using Layout = KLayout<HighBits>;  // w = (d * sc) * q - dmin * m
#if KVSERVE_VEC
  template <typename W>
  static AffineGroup<W, 4 + HighBits> group(const W& w, const uint8_t* block, int s) {
    const auto scale = W::mul(w.halves(Layout::d(block)), w.u8s(Layout::scales(block, s)));
    const auto low = W::mul(w.halves(Layout::dmin(block)),
                            W::mul(w.u8s(Layout::mins(block, s)), W::set1(-1.f)));
    return {scale, low};
  }
#endif
#if KVSERVE_Q8_ZMM
  // dequantize_slab's values of a row: gguf's scale * q - dmin * m (a: scale, b: -(dmin * m),
  // the group terms' lanes; x - y and x + (-y) are the same float)
  static void row_values(float a, float b, __m512i q0, __m512i q1, float* out) {
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q0), _mm512_set1_ps(a)),
                                        _mm512_set1_ps(b)));
    _mm512_storeu_ps(out + 16, _mm512_add_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(a)), _mm512_set1_ps(b)));
  }
#endif
  static float scalar(const uint8_t* block, int s, int64_t n, const int dots[2],
                      const QuantizedRows& xq, int64_t m, int64_t g) {
    const int64_t row = n % kInt4Panel;
    const float scale = half_at(Layout::d(block), n) * Layout::scales(block, s)[row];
    const float low = half_at(Layout::dmin(block), n) * Layout::mins(block, s)[row];
    return affine_scalar(scale, -low, dots, xq, m, g);
  }
};

struct Q6_KKernel {
  using Layout = Q6_KLayout;  // w = (d * sc_j) * (q - 32), sub-blocks j of 16
#if KVSERVE_VEC
  template <typename W> static Q6Group<W> group(const W& w, const uint8_t* block, int s) {
    const auto d = w.halves(Layout::d(block));
    return {W::mul(d, w.i8s(Layout::scales(block, 2 * s))),
            W::mul(d, w.i8s(Layout::scales(block, 2 * s + 1)))};
  }
#endif
#if KVSERVE_Q8_ZMM
  // dequantize_slab's values of a row: gguf's (d * scale_j) * (q - 32) (a, b: the sub-blocks')
  static void row_values(float a, float b, __m512i q0, __m512i q1, float* out) {
    const __m512i offset = _mm512_set1_epi32(32);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(a),
                                        _mm512_cvtepi32_ps(_mm512_sub_epi32(q0, offset))));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_set1_ps(b),
                                             _mm512_cvtepi32_ps(_mm512_sub_epi32(q1, offset))));
  }
#endif
  static float scalar(const uint8_t* block, int s, int64_t n, const int dots[2],
                      const QuantizedRows& xq, int64_t m, int64_t g) {
    const float d = half_at(Layout::d(block), n);
    const int64_t row = n % kInt4Panel;
    const auto first = static_cast<int8_t>(Layout::scales(block, 2 * s)[row]);
    const auto second = static_cast<int8_t>(Layout::scales(block, 2 * s + 1)[row]);
    const int32_t head = xq.half_sum_at(m, g), tail = xq.code_sum_at(m, g) - head;
    return xq.step_at(m, g) * (d * first * static_cast<float>(dots[0] - 32 * head) +
                               d * second * static_cast<float>(dots[1] - 32 * tail));
  }
};

// MXFP4: w = d * value(q) = d * u - 12 d with u = kMxfp4Offset[q] (the unpacked codes are
// looked up into u: unpack_group), an affine group as Q4_0's.
struct Mxfp4Kernel {
  using Layout = Mxfp4Layout;
#if KVSERVE_VEC
  template <typename W> static AffineGroup<W, 5> group(const W& w, const uint8_t* block, int) {
    const auto d = w.floats(Layout::d(block));
    return {d, W::mul(d, W::set1(-12.f))};
  }
#endif
  static float scalar(const uint8_t* block, int, int64_t n, const int dots[2],
                      const QuantizedRows& xq, int64_t m, int64_t g) {
    float d;
    std::memcpy(&d, Layout::d(block) + 4 * (n % kInt4Panel), sizeof(d));
    return affine_scalar(d, -12.f * d, dots, xq, m, g);
  }
};

// ---- the panels

template <typename L> void prefetch_group(const uint8_t* block, int s) {
#if KVSERVE_VEC
  constexpr int64_t kShare = L::kBytes / L::kGroups;  // the stream advances this much a group
  const uint8_t* ahead = block + s * kShare + kPrefetchBytes;
  for (int64_t line = 0; line < kShare; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
#endif
}

#if KVSERVE_VEC
// Group s's 8 code vectors: the low 4 bits as int4_linear_q8 unpacks them (chunk c: 2c = & 0x0F,
// 2c + 1 = >> 4 & 0x0F), then vector v's high bits from its plane bits (gguf_layouts.h) shifted
// onto bit 4 (and 5), masked and merged. Always inlined: called, GCC passed the vectors through
// memory (Q5_K at 64 rows: ~15% slower).
template <typename L, typename W>
[[gnu::always_inline]] inline void unpack_group(const W& w, const uint8_t* block, int s,
                                                typename W::I codes[8]) {
  const auto low4 = W::set8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const auto words = w.bytes(L::codes(block, s) + c * kInt4ChunkBytes);
    codes[2 * c] = W::and_(words, low4);
    codes[2 * c + 1] = W::and_(W::shift(words, -4), low4);
  }
  if constexpr (L::kTable) {
    for (int v = 0; v < 8; ++v) codes[v] = W::lookup(codes[v], kMxfp4Offset);
  }
  if constexpr (L::kHighBits > 0) {
    typename W::I planes[L::kHighBits];
    for (int i = 0; i < L::kHighBits; ++i) planes[i] = w.bytes(L::planes(block, s) + 64 * i);
    const auto high = W::set8(((1 << L::kHighBits) - 1) << 4);
    for (int v = 0; v < 8; ++v) {  // unrolled: the shift counts are immediates
      const int bit = v * L::kHighBits;  // vector v's first plane bit
      codes[v] = W::or_(codes[v], W::and_(W::shift(planes[bit / 8], 4 - bit % 8), high));
    }
  }
}

// out[m][16] for R rows from m0 over a panel (W: a whole one or half of it). Per group the code
// vectors are unpacked once and stay in registers while each row's dot runs over them (rows
// outer: one accumulator each, as int4_half_panel).
template <int R, typename Kernel, typename W>
void gguf_panel(const QuantizedRows& xq, int64_t m0, const uint8_t* panel, const W& w,
                float* out) {
  using L = typename Kernel::Layout;
  typename W::F total[R];
  for (int m = 0; m < R; ++m) total[m] = W::zero();
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + (g / L::kGroups) * L::kBytes;
    const int s = static_cast<int>(g % L::kGroups);
    if (w.leads()) prefetch_group<L>(block, s);
    typename W::I codes[8];
    unpack_group<L>(w, block, s, codes);
    const auto terms = Kernel::group(w, block, s);
    for (int m = 0; m < R; ++m) terms.add_row(total[m], codes, xq, m0 + m, g);
  }
  for (int m = 0; m < R; ++m) w.store(out + m * 16, total[m]);
}
#endif

template <typename Kernel>
float gguf_dot_scalar(const QuantizedRows& xq, int64_t m, const uint8_t* panel, int64_t n) {
  using L = typename Kernel::Layout;
  float acc = 0.f;
  for (int64_t g = 0; g < xq.groups; ++g) {
    const uint8_t* block = panel + (g / L::kGroups) * L::kBytes;
    const int s = static_cast<int>(g % L::kGroups);
    const int8_t* x = xq.group_codes(m, g);
    int dots[2] = {0, 0};
    for (int k = 0; k < 32; ++k) {
      int code = code_at<L>(block, s, n, k);
      if constexpr (L::kTable) code = kMxfp4Offset[code];
      dots[k / 16] += code * x[stored_position(k, CodeOrder::kInt4Lanes)];
    }
    acc += Kernel::scalar(block, s, n, dots, xq, m, g);
  }
  return acc;
}

template <typename Kernel>
void gguf_q8(const QuantizedRows& xq, const PanelSpan& span, const at::Tensor& packed,
             int64_t out_features, const OutputRows& y) {
  auto tile = [&](int block_rows, int64_t m0, const uint8_t* panel, float* out) {
#if KVSERVE_Q8_ZMM
    with_row_count(block_rows, [&](auto r) {
      gguf_panel<decltype(r)::value, Kernel>(xq, m0, panel, ZmmPanel(), out);
    });
#elif KVSERVE_VEC
    panel_rows(block_rows, [&](auto r, int half) {
      gguf_panel<decltype(r)::value, Kernel>(xq, m0, panel, YmmHalf{half}, out);
    });
#endif
  };
  auto scalar = [&](int64_t m, const uint8_t* panel, int64_t n) {
    return gguf_dot_scalar<Kernel>(xq, m, panel, n);
  };
  const int64_t panel_bytes = packed.size(1) * Kernel::Layout::kBytes;
  run_span(xq, span, out_features, panel_bytes, packed.data_ptr<uint8_t>(), y, tile, scalar);
}

PanelKernel integer_kernel(GgufType type) {
  switch (type) {
    case GgufType::kQ5_0: return gguf_q8<Q5_0Kernel>;
    case GgufType::kQ5_1: return gguf_q8<Q5_1Kernel>;
    case GgufType::kQ4_K: return gguf_q8<KKernel<0>>;
    case GgufType::kQ5_K: return gguf_q8<KKernel<1>>;
    case GgufType::kQ6_K: return gguf_q8<Q6_KKernel>;
    case GgufType::kMXFP4: return gguf_q8<Mxfp4Kernel>;
    default: return nullptr;  // the int4 and int8 layouts' own kernels
  }
}

void check_linear(const GgufFormat& format, const at::Tensor& x, const at::Tensor& panels,
                  const c10::optional<at::Tensor>& bias, int64_t out_features, const char* op) {
  check_x(x, op);
  check_panels(format, panels, x.size(1), op);
  TORCH_CHECK_VALUE(panels.size(0) == (out_features + kInt4Panel - 1) / kInt4Panel, op, ": ",
                    panels.size(0), " panels cannot hold ", out_features, " outputs");
  TORCH_CHECK_VALUE(!bias || bias->numel() == out_features, op, ": bias must be [N]");
}

#if KVSERVE_Q8_ZMM
// The 8 code vectors (vector v: lane n = row n's codes at stored positions 4v..4v+3) as rows:
// dword-wise 8 x 16 -> 16 x 8 by in-lane unpacks (a gather a row was slower than the loop it
// replaced: Intel's gather mitigation). 128-bit lane L of halves[r] holds row 4L + r's stored
// positions 0..15, of halves[4 + r] its 16..31.
inline void transpose_rows(const __m512i codes[8], uint8_t (*halves)[64]) {
  __m512i pairs[8];
  for (int i = 0; i < 4; ++i) {
    pairs[2 * i] = _mm512_unpacklo_epi32(codes[2 * i], codes[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_epi32(codes[2 * i], codes[2 * i + 1]);
  }
  for (int half = 0; half < 2; ++half) {
    const __m512i* t = pairs + 4 * half;  // vectors 4 half .. 4 half + 3
    _mm512_store_si512(halves[4 * half + 0], _mm512_unpacklo_epi64(t[0], t[2]));
    _mm512_store_si512(halves[4 * half + 1], _mm512_unpackhi_epi64(t[0], t[2]));
    _mm512_store_si512(halves[4 * half + 2], _mm512_unpacklo_epi64(t[1], t[3]));
    _mm512_store_si512(halves[4 * half + 3], _mm512_unpackhi_epi64(t[1], t[3]));
  }
}

// Rows [first, first + out.size(0)) of W (first a multiple of 16) into out (float32 or
// bfloat16), gguf's float32 values to the bit, from the integer kernel's unpacked code vectors.
// Why: the per-row loop (gguf_pack.cpp's dequantize_panel_rows, bit by bit out of the panel
// layout) ran at ~0.5 G weights a second a core, ~15% of a 256-token Qwen3-30B-shaped prefill
// (its attention projections take this path). Per (panel, group): the 8 code vectors (lane n
// = row n's codes for 4 stored positions) are transposed into rows, each row's 32 codes put in
// k order (one byte shuffle), widened and scaled per the format.
template <typename Kernel>
void dequantize_slab(const at::Tensor& panels, int64_t first, at::Tensor& out) {
  using L = typename Kernel::Layout;
  const int64_t count = out.size(0), groups = out.size(1) / 32;
  const int64_t panel_bytes = panels.size(1) * L::kBytes;
  const uint8_t* data = panels.data_ptr<uint8_t>() + (first / kInt4Panel) * panel_bytes;
  const bool to_float = out.scalar_type() == at::kFloat;
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t row_bytes = out.size(1) * out.element_size();
  at::parallel_for(0, (count + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    const ZmmPanel w;
    alignas(64) uint8_t halves[8][64];
    alignas(64) float a[16], b[16], values[32];
    // stored position of k in its chunk of 8: (k0, k4, k1, k5, k2, k6, k3, k7)
    const __m256i natural = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                             0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = data + p * panel_bytes;
      const int64_t rows = std::min<int64_t>(16, count - p * 16);
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = panel + (g / L::kGroups) * L::kBytes;
        const int s = static_cast<int>(g % L::kGroups);
        typename ZmmPanel::I codes[8];
        unpack_group<L>(w, block, s, codes);
        transpose_rows(codes, halves);
        Kernel::group(w, block, s).lanes(a, b);
        for (int64_t n = 0; n < rows; ++n) {
          // row n = 4 lane + r: stored positions 0..15 in halves[r], 16..31 in halves[4 + r]
          const int64_t lane = 16 * (n / 4), r = n % 4;
          const __m256i stored = _mm256_loadu2_m128i(
              reinterpret_cast<const __m128i*>(halves[4 + r] + lane),
              reinterpret_cast<const __m128i*>(halves[r] + lane));
          const __m256i q = _mm256_shuffle_epi8(stored, natural);
          Kernel::row_values(a[n], b[n], _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)),
                             _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)), values);
          uint8_t* row = dst + (p * 16 + n) * row_bytes;
          if (to_float) {
            std::memcpy(reinterpret_cast<float*>(row) + 32 * g, values, sizeof(values));
          } else {
            to_bf16_bits(values, reinterpret_cast<uint16_t*>(row) + 32 * g, 32);
          }
        }
      }
    }
  });
}
#endif

// Rows [first, first + out.size(0)) of W into out: the vector path for the K-quants, the per-row
// loop for the other formats (and builds).
void dequantize_slab(const GgufFormat& format, const at::Tensor& panels, int64_t first,
                     at::Tensor& out) {
#if KVSERVE_Q8_ZMM
  switch (format.type) {
    case GgufType::kQ4_K: return dequantize_slab<KKernel<0>>(panels, first, out);
    case GgufType::kQ5_K: return dequantize_slab<KKernel<1>>(panels, first, out);
    case GgufType::kQ6_K: return dequantize_slab<Q6_KKernel>(panels, first, out);
    default: break;
  }
#endif
  dequantize_panel_rows(format, panels, nullptr, first, out);
}

// Rows of W dequantized a slab at a time: ~4 MB of scratch, read back from cache by the GEMM,
// and 64 to 512 rows, so at::linear still gets a wide GEMM.
int64_t slab_rows(int64_t cols, int64_t element_size) {
  const int64_t rows = (int64_t{4} << 20) / (cols * element_size);
  return std::clamp<int64_t>(rows / kInt4Panel * kInt4Panel, 64, 512);
}

}  // namespace

at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& panels, const std::string& qtype,
                          const c10::optional<at::Tensor>& bias, int64_t out_features) {
  const GgufFormat& format = gguf_format(qtype);
  check_linear(format, x, panels, bias, out_features, "gguf_linear_q8");
  if (format.type == GgufType::kQ4_0 || format.type == GgufType::kQ4_1)
    return int4_linear_q8(x, panels, bias, out_features);
  if (format.type == GgufType::kQ8_0) return int8_linear_q8(x, panels, bias, out_features);
  return with_quantized_rows(x, bias, out_features, CodeOrder::kInt4Lanes,
                             integer_kernel(format.type), panels);
}

SpanKernel gguf_span_kernel(const std::string& qtype) {
  const GgufType type = gguf_format(qtype).type;
  if (type == GgufType::kQ4_0 || type == GgufType::kQ4_1) return {int4_q8_kernel()};
  if (type == GgufType::kQ8_0) return {int8_q8_kernel(), CodeOrder::kNatural};
  return {integer_kernel(type)};
}

at::Tensor gguf_linear_dequant(const at::Tensor& x, const at::Tensor& panels,
                               const std::string& qtype, const c10::optional<at::Tensor>& bias,
                               int64_t out_features) {
  const GgufFormat& format = gguf_format(qtype);
  check_linear(format, x, panels, bias, out_features, "gguf_linear_dequant");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const int64_t slab = std::min(slab_rows(x.size(1), x.element_size()), out_features);
  // kept between calls: a fresh 4 MB buffer a call cost ~1,000 page faults (~0.5 ms)
  thread_local at::Tensor kept;
  if (!kept.defined() || kept.scalar_type() != x.scalar_type() ||
      kept.numel() < slab * x.size(1))
    kept = at::empty({slab * x.size(1)}, x.options());
  const at::Tensor scratch = kept.narrow(0, 0, slab * x.size(1)).view({slab, x.size(1)});
  const at::Tensor own_bias = bias ? bias->to(x.scalar_type()) : at::Tensor();
  for (int64_t first = 0; first < out_features; first += slab) {
    const int64_t rows = std::min(slab, out_features - first);
    at::Tensor weight = scratch.narrow(0, 0, rows);
    dequantize_slab(format, panels, first, weight);
    const at::Tensor part = at::linear(x, weight, bias ? own_bias.narrow(0, first, rows)
                                                       : at::Tensor());
    out.narrow(1, first, rows).copy_(part);
  }
  return out;
}

}  // namespace kvserve
