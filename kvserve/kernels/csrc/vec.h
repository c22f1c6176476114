// Vector helpers shared by the kernel sources, for every instruction-set level a build targets.
//
// `vf` is the widest float vector of the build: 16 lanes (__m512) with AVX-512, 8 lanes (__m256)
// with AVX2 + FMA; KVSERVE_VEC is 0 for the portable scalar build. Kernels written against these
// helpers get their AVX2 and AVX-512 variants from one source (kvserve/kernels/isa.py builds each
// level with its own -march); only code that needs an instruction with no AVX2 equivalent
// (vdpbf16ps, masked stores) is written per level.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define KVSERVE_VEC 16
#elif defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_VEC 8
#else
#define KVSERVE_VEC 0
#endif

namespace kvserve {

#if KVSERVE_VEC == 16
constexpr int kLanes = 16;
constexpr int kVecRegisters = 32;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {  // bf16 -> float is a 16-bit shift
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline vf vload(const int8_t* p) {  // int8 codes -> float
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
}
// Rounded floats (already integral, within int8's range) -> int8 codes.
inline void vstore_codes(int8_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
// fp8 e4m3 codes -> their values / 256 (fp8_bits_as_half: exact; row_scale folds the 256 in).
inline vf vload(const c10::Float8_e4m3fn* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(
      _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7),
      _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(half);
}
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float v) { return _mm512_set1_ps(v); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vround(vf a) {  // to nearest, ties to even
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vmaxall(vf a) { return _mm512_reduce_max_ps(a); }
inline bool vany_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
inline vf vpow2(vf y, vf n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
constexpr float kExpLow = -88.3762626647949f;  // scalef takes exponents into the denormals
constexpr float kExpHigh = 88.3762626647949f;
#elif KVSERVE_VEC == 8
constexpr int kLanes = 8;
constexpr int kVecRegisters = 16;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline vf vload(const int8_t* p) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
}
inline vf vload(const c10::Float8_e4m3fn* p) {  // see the AVX-512 one
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), 7),
                                    _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(half);
}
inline void vstore_codes(int8_t* p, vf v) {
  const __m256i words = _mm256_cvtps_epi32(v);
  const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(words),
                                         _mm256_extracti128_si256(words, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(halves, halves));
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float v) { return _mm256_set1_ps(v); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmaxall(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline bool vany_nan(vf a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
inline vf vpow2(vf y, vf n) {  // y * 2^n for integral n in [-126, 127], through the exponent bits
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
constexpr float kExpLow = -87.0f;  // keeps 2^n normal: e^-87 ~ 1.6e-38 stands for 0
constexpr float kExpHigh = 88.0f;  // 2^127 at most
#endif

#if KVSERVE_VEC
// e^x per lane: Cephes' polynomial for e^r on [-ln2/2, ln2/2] scaled by 2^n; ~1 ulp, far faster
// than a call to std::exp per lane (which dominated softmax and SiLU when scalar).
inline vf vexp(vf x) {
  x = vmax(vmin(x, vset1(kExpHigh)), vset1(kExpLow));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf y = vset1(1.9875691500e-4f);
  y = vfma(y, r, vset1(1.3981999507e-3f));
  y = vfma(y, r, vset1(8.3334519073e-3f));
  y = vfma(y, r, vset1(4.1665795894e-2f));
  y = vfma(y, r, vset1(1.6666665459e-1f));
  y = vfma(y, r, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), vadd(r, vset1(1.f)));
  return vpow2(y, n);
}
#endif

#if KVSERVE_VEC == 16
inline __m512 exp16(__m512 x) { return vexp(x); }  // the AVX-512-only kernels' name for it
#endif

// values[i] = exp(values[i] - shift); returns their sum.
inline float exp_shifted_sum(float* values, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if KVSERVE_VEC
  vf acc = vzero(), s = vset1(shift);
  for (; i + kLanes <= n; i += kLanes) {
    const vf e = vexp(vsub(vload(values + i), s));
    vstore(values + i, e);
    acc = vadd(acc, e);
  }
  total = vsum(acc);
#endif
  for (; i < n; ++i) {
    values[i] = std::exp(values[i] - shift);
    total += values[i];
  }
  return total;
}

// sum of a[i] * b[i] in float (a float32 or bf16): vector FMAs over whole vectors, the tail after.
template <typename T> inline float dot(const T* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if KVSERVE_VEC
  vf acc = vzero();
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  total = vsum(acc);
#endif
  for (; i < n; ++i) total += static_cast<float>(a[i]) * b[i];
  return total;
}

inline float max_of(const float* values, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if KVSERVE_VEC
  vf acc = vset1(best);
  for (; i + kLanes <= n; i += kLanes) acc = vmax(acc, vload(values + i));
  best = vmaxall(acc);
#endif
  for (; i < n; ++i) best = std::max(best, values[i]);
  return best;
}

// The maximum of values[0..n), and whether any is NaN (vmax would drop it): logits rows.
inline float max_of_checked(const float* values, int64_t n, bool& has_nan) {
  has_nan = false;
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if KVSERVE_VEC
  vf acc = vset1(best);
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = vload(values + i);
    has_nan |= vany_nan(v);
    acc = vmax(acc, v);
  }
  best = vmaxall(acc);
#endif
  for (; i < n; ++i) {
    has_nan |= std::isnan(values[i]);
    best = std::max(best, values[i]);
  }
  return best;
}

#if KVSERVE_VEC == 16
// float bits -> bf16 bits in the low half of each 32-bit lane, round to nearest even; NaN -> 0x7FC0
// (as c10::BFloat16), for builds without vcvtneps2bf16.
inline __m512i bf16_round_bits(__m512i bits) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(bits),
                                           _mm512_castsi512_ps(bits), _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
}
#elif KVSERVE_VEC == 8
inline __m256i bf16_round_bits(__m256i bits) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(bits),
                                   _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}
#endif

// float -> bf16 bits, rounding to nearest even (as c10::BFloat16).
inline void to_bf16_bits(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  for (; i + 16 <= n; i += 16) {
    __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<__m256i&>(packed));
  }
#elif KVSERVE_VEC == 16
  for (; i + 16 <= n; i += 16) {
    const __m512i rounded = bf16_round_bits(_mm512_castps_si512(_mm512_loadu_ps(src + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(rounded));
  }
#elif KVSERVE_VEC == 8
  for (; i + 8 <= n; i += 8) {
    const __m256i rounded = bf16_round_bits(_mm256_castps_si256(_mm256_loadu_ps(src + i)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                            _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
#endif
  for (; i < n; ++i) {
    const c10::BFloat16 value(src[i]);
    std::memcpy(dst + i, &value, sizeof(uint16_t));
  }
}

#if defined(__AVX512BF16__)
// Two rows of 32 bf16 -> their pairs (a[d], b[d]) as 32-bit lanes: low gets d 0..15, high 16..31.
// The pair layout vdpbf16ps reduces over (keys, for P.V).
inline void interleave_bf16(__m512i a, __m512i b, __m512i& low, __m512i& high) {
  const __m512i low_index = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high_index = _mm512_set_epi16(
      63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  low = _mm512_permutex2var_epi16(a, low_index, b);
  high = _mm512_permutex2var_epi16(a, high_index, b);
}
#endif

// ---- KV cache rows. A float or bf16 cache row is head_dim values; a quantized row is head_dim
// codes followed by its float32 scale (4 bytes): value = code * scale (kvserve/kernels/
// reference.py's quantize_kv_rows). The codes are int8, or fp8 e4m3 (c10::Float8_e4m3fn: an
// fp8 cache is a uint8 tensor of its bytes). The scale travels with its row, so block copies
// need no side tensor.
template <typename C> constexpr int64_t kRowExtra = 0;
template <> constexpr int64_t kRowExtra<int8_t> = 4;
template <> constexpr int64_t kRowExtra<c10::Float8_e4m3fn> = 4;
template <typename C> constexpr bool kQuantizedRows = kRowExtra<C> != 0;

// Elements from one cached row to the next head's (or token's) in a cache of element type C.
template <typename C> constexpr int64_t cache_row_width(int64_t head_dim) {
  return head_dim + kRowExtra<C>;
}

// fp8 e4m3 -> float, exactly, as value / 256: the 7 bits below the sign shifted left by 7 are
// an fp16 whose 5-bit exponent field holds e4m3's 4 bits (bias 15 against 7: 2^-8) and whose
// mantissa starts with e4m3's 3 bits; fp16 subnormals are e4m3's, at the same 2^-8. The vector
// loads (vload) convert the fp16 with F16C; row_scale multiplies the 256 back into the scale
// (powers of two: the products are exact). NaN codes (0x7F, 0xFF) are never written.
inline uint16_t fp8_bits_as_half(uint8_t bits) {
  return static_cast<uint16_t>(((bits & 0x7F) << 7) | ((bits & 0x80) << 8));
}
constexpr float kFp8LoadFactor = 256.f;

// One code as the vector loads give it (the scalar tails' vload): int8 as it is, fp8 / 256.
inline float loaded_code(int8_t code) { return static_cast<float>(code); }
inline float loaded_code(c10::Float8_e4m3fn code) {
  return static_cast<float>(c10::Half(fp8_bits_as_half(code.x), c10::Half::from_bits()));
}

// The factor a row's stored values carry: 1 for float and bf16 rows, the scale for int8 rows,
// the scale x 256 for fp8 rows (loaded as value / 256).
inline float row_scale(const float*, int64_t) { return 1.f; }
inline float row_scale(const c10::BFloat16*, int64_t) { return 1.f; }
inline float row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(float));
  return scale;
}
inline float row_scale(const c10::Float8_e4m3fn* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(float));
  return scale * kFp8LoadFactor;
}

// A cached row -> its n values as floats: float rows copied, bf16 rows widened, quantized rows
// (n int8 or fp8 codes, then their float32 scale) code * scale (fp8 loads give code / 256 and
// their row_scale the scale x 256).
inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if KVSERVE_VEC
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename C, typename = std::enable_if_t<kQuantizedRows<C>>>
inline void load_row(const C* src, float* dst, int64_t n) {
  const float scale = row_scale(src, n);
  int64_t i = 0;
#if KVSERVE_VEC
  const vf s = vset1(scale);
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vmul(vload(src + i), s));
#endif
  for (; i < n; ++i) dst[i] = loaded_code(src[i]) * scale;
}

// Element offset of the K row of token `pos` for one KV head in a paged cache half laid out
// [blocks, block_size, num_kv_heads, head_dim]; the block comes from the sequence's table.
inline int64_t cache_row_offset(const int32_t* table, int64_t block_size, int64_t num_kv_heads,
                                int64_t head_dim, int64_t pos, int64_t kv_head) {
  const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size +
                       pos % block_size;
  return (slot * num_kv_heads + kv_head) * head_dim;
}

// The bf16 attention kernels (flash and decode) need AVX512-BF16 and a head size of 64 or 128.
inline bool bf16_attention_supported(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

}  // namespace kvserve
