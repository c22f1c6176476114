// The GGUF block formats' code vectors and per-group terms, shared by the integer-dot and
// dequantizing kernels (gguf_gemm.cpp) and the AMX tile kernels (gguf_amx.cpp): a register width
// (ymm halves of a panel, or a whole panel per zmm), each format's group terms (scale and low,
// or Q6_K's two sub-block scales) and the unpacking of a group's 8 code vectors (lane n = output
// row n's codes at 4 stored positions). Internal linkage: each including file gets its own.
#pragma once

#include <algorithm>
#include <cstring>

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

  // ---- the super-block kernels' integer terms (gguf_gemm.cpp)
  F load(const float* p) const { return _mm256_loadu_ps(p + 8 * half); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  // an int16 pair a 32-bit lane: (lo[n], hi[n]) of 8-bit values (unsigned, or signed)
  I pairs(const uint8_t* lo, const uint8_t* hi, bool is_signed) const {
    const I low = _mm256_and_si256(widen_bytes(lo, is_signed), _mm256_set1_epi32(0xFFFF));
    return _mm256_or_si256(low, _mm256_slli_epi32(widen_bytes(hi, is_signed), 16));
  }
  // a sub-block's per-row scale as the multiplier dot_scaled takes: (s, s) in int16
  I scale_lanes(const uint8_t* p, bool is_signed) const { return pairs(p, p, is_signed); }
  // acc + scale * the dots of Count code vectors with x's codes: dot's int16 runs widened by
  // vpmaddwd against (s, s) instead of (1, 1), so the scaling is free (|s| <= 128:
  // 2 * 32,767 * 128 < 2^31)
  template <int Bits, int Count>
  static I dot_scaled(I acc, const I* codes, const int8_t* x, I scale) {
    constexpr int kRun = 32767 / (2 * ((1 << Bits) - 1) * 127);
    for (int i = 0; i < Count; i += kRun) {
      I run = _mm256_maddubs_epi16(codes[i], broadcast_code_word(x + 4 * i));
      for (int j = i + 1; j < std::min(Count, i + kRun); ++j)
        run = _mm256_add_epi16(run, _mm256_maddubs_epi16(codes[j], broadcast_code_word(x + 4 * j)));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(run, scale));
    }
    return acc;
  }
  // acc + each lane's int16 pair dotted with the pair at p (two int16, broadcast)
  static I pair_dot(I acc, I pairs, const int16_t* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi32(word)));
  }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I shift32(I v, int bits) { return _mm256_slli_epi32(v, bits); }
  // Q6_K's -32 offsets: per super-block through x's code sums (Q6SuperBlock::value), not as
  // seeds of the sub-block dots: dot_scaled's int16 runs would overflow with them
  static constexpr bool kSeededSubBlocks = false;

 private:
  I widen_bytes(const uint8_t* p, bool is_signed) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half));
    return is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
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

  // ---- the super-block kernels' integer terms (gguf_gemm.cpp)
  F load(const float* p) const { return _mm512_loadu_ps(p); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  I pairs(const uint8_t* lo, const uint8_t* hi, bool is_signed) const {
    const I low = _mm512_and_si512(widen_bytes(lo, is_signed), _mm512_set1_epi32(0xFFFF));
    return _mm512_or_si512(low, _mm512_slli_epi32(widen_bytes(hi, is_signed), 16));
  }
  // a sub-block's per-row scale as int32 lanes
  I scale_lanes(const uint8_t* p, bool is_signed) const { return widen_bytes(p, is_signed); }
  // acc + scale * the dots (vpmulld: one per Count vpdpbusd). Sums stay far below 2^31: a
  // super-block's is at most 8 x 32 x 31 x 127 x 63 (Q5_K), or 16 x 16 x 63 x 127 x 128 (Q6_K).
  template <int Bits, int Count>
  static I dot_scaled(I acc, const I* codes, const int8_t* x, I scale) {
    return _mm512_add_epi32(acc, _mm512_mullo_epi32(dot_codes<Count>(_mm512_setzero_si512(),
                                                                     codes, x), scale));
  }
  // acc + scale * (seed + the dots of 4 code vectors), one chain (a sub-block's two would cost
  // an add): Q6_K's sub-blocks with their -32 offsets as the seeds (x's -32 sum(xq_j),
  // QuantizedRows::seed16). Why: summed per super-block instead (8 vpdpwssd a row, their
  // addresses, the scales' pairs), the offsets took ~a quarter of the kernel's time; seeded,
  // a 16-row LM head (128256 x 2048) went from ~425 to ~500 G multiply-adds a second (Zen 5,
  // 2 cores), a 512-row 2048 x 8192 from ~430 to ~475.
  static I dot_seeded(I acc, const I* codes, const int8_t* x, const int32_t* seed, I scale) {
    I dot = _mm512_set1_epi32(*seed);
    for (int i = 0; i < 4; ++i) dot = dot_add_broadcast(dot, codes[i], x + 4 * i);
    return _mm512_add_epi32(acc, _mm512_mullo_epi32(dot, scale));
  }
  static constexpr bool kSeededSubBlocks = true;
  // acc + each lane's int16 pair dotted with the pair at p, broadcast in the instruction
  static I pair_dot(I acc, I pairs, const int16_t* p) {
    asm("vpdpwssd %2%{1to16%}, %1, %0"
        : "+v"(acc)
        : "v"(pairs), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I shift32(I v, int bits) { return _mm512_slli_epi32(v, bits); }

 private:
  static I widen_bytes(const uint8_t* p, bool is_signed) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
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

#if KVSERVE_Q8_ZMM
// gguf's values at 16 stored positions of a group from their codes q: lane n output n's, with
// the group terms' lanes (gguf_amx.cpp), or one row's, with its terms broadcast
// (dequantize_slab); `second`: positions 16..31 (Q6_K's second sub-block). gguf's float
// operations, so its bits: scale * q - dmin * m as q * scale + low (x + (-y) is x - y), and
// (d * scale_j) * (q - 32).
template <int Bits>
__m512 group_values(const AffineGroup<ZmmPanel, Bits>& terms, bool, __m512i q) {
  return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), terms.scale), terms.low);
}
inline __m512 group_values(const Q6Group<ZmmPanel>& terms, bool second, __m512i q) {
  return _mm512_mul_ps(second ? terms.second : terms.first,
                       _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))));
}
#endif
#endif

// ---- per (row, super-block of 256) terms of the K-quants, x at one step a super-block
// (QuantizedRows with kSuperBlockGroups): the sub-blocks' integer dots are scaled by their
// integer scales and summed in int32 (add_scaled, per group), and the float work is once a
// super-block (value), not once a group.

#if KVSERVE_VEC
// Q4_K, Q5_K: y += d step sum_j sc_j dot_j - dmin step sum_j m_j sum(xq_j)
template <typename W> struct KSuperBlock {
  typename W::F d, neg_dmin;
  typename W::I mins[4];  // lane n: (m_2i, m_2i+1) of row n, int16

  typename W::F value(typename W::I sum, const QuantizedRows& xq, int64_t m, int64_t g0) const {
    auto low = W::set32(0);
    for (int i = 0; i < 4; ++i) low = W::pair_dot(low, mins[i], xq.sum32_at(m, g0 + 2 * i));
    const auto step = W::set1(xq.step_at(m, g0));
    return W::fma(W::cvt(sum), W::mul(d, step), W::mul(W::cvt(low), W::mul(neg_dmin, step)));
  }
};

// Q6_K: y += d step sum_j sc_j (dot_j - 32 sum(xq_j)), sub-blocks j of 16; with
// W::kSeededSubBlocks the sums come with the -32 terms (add_scaled seeded the dots with them)
template <typename W> struct Q6SuperBlock {
  typename W::F d;
  typename W::I scales[8];  // lane n: (sc_2g, sc_2g+1) of row n, int16: group g's sub-blocks

  typename W::F value(typename W::I sum, const QuantizedRows& xq, int64_t m, int64_t g0) const {
    auto exact = sum;
    if constexpr (!W::kSeededSubBlocks) {
      auto offset = W::set32(0);
      for (int g = 0; g < 8; ++g)
        offset = W::pair_dot(offset, scales[g], xq.sum16_at(m, g0 + g));
      exact = W::sub32(sum, W::shift32(offset, 5));  // - 32 sum_j sc_j sum(xq_j)
    }
    return W::mul(W::cvt(exact), W::mul(d, W::set1(xq.step_at(m, g0))));
  }
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
  // the super-block kernels: group s's scaled dots for R rows from m0, and the block's terms
  template <int R, typename W>
  static void add_scaled(const W& w, const uint8_t* block, int s, const typename W::I codes[8],
                         const QuantizedRows& xq, int64_t m0, int64_t g, typename W::I* sums) {
    const auto scale = w.scale_lanes(Layout::scales(block, s), false);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m)
      sums[m] = W::template dot_scaled<4 + HighBits, 8>(sums[m], codes, xq.group_codes(m0 + m, g),
                                                        scale);
  }
  template <typename W> static KSuperBlock<W> superblock(const W& w, const uint8_t* block) {
    KSuperBlock<W> terms{w.halves(Layout::d(block)),
                         W::mul(w.halves(Layout::dmin(block)), W::set1(-1.f)), {}};
    for (int i = 0; i < 4; ++i)
      terms.mins[i] = w.pairs(Layout::mins(block, 2 * i), Layout::mins(block, 2 * i + 1), false);
    return terms;
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
  template <int R, typename W>
  static void add_scaled(const W& w, const uint8_t* block, int s, const typename W::I codes[8],
                         const QuantizedRows& xq, int64_t m0, int64_t g, typename W::I* sums) {
    const auto first = w.scale_lanes(Layout::scales(block, 2 * s), true);
    const auto second = w.scale_lanes(Layout::scales(block, 2 * s + 1), true);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const int8_t* x = xq.group_codes(m0 + m, g);
      if constexpr (W::kSeededSubBlocks) {
        const int32_t* seeds = xq.seed16_at(m0 + m, g);
        sums[m] = W::dot_seeded(sums[m], codes, x, seeds, first);
        sums[m] = W::dot_seeded(sums[m], codes + 4, x + 16, seeds + 1, second);
      } else {
        sums[m] = W::template dot_scaled<6, 4>(sums[m], codes, x, first);
        sums[m] = W::template dot_scaled<6, 4>(sums[m], codes + 4, x + 16, second);
      }
    }
  }
  template <typename W> static Q6SuperBlock<W> superblock(const W& w, const uint8_t* block) {
    Q6SuperBlock<W> terms{w.halves(Layout::d(block)), {}};
    if constexpr (!W::kSeededSubBlocks) {
      for (int g = 0; g < 8; ++g)
        terms.scales[g] = w.pairs(Layout::scales(block, 2 * g),
                                  Layout::scales(block, 2 * g + 1), true);
    }
    return terms;
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

// ---- reading a panel's groups

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
#endif

}  // namespace
}  // namespace kvserve
