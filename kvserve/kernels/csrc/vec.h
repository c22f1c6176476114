// AVX-512 helpers shared by the kernel sources.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {

#if defined(__AVX512F__)
// exp on 16 floats: Cephes' polynomial for e^r on [-ln2/2, ln2/2] scaled by 2^n; ~1 ulp, far
// faster than 16 calls to std::exp (which dominated softmax and SiLU when scalar).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}
#endif

// values[i] = exp(values[i] - shift); returns their sum.
inline float exp_shifted_sum(float* values, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps(), s = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(values + i), s));
    _mm512_storeu_ps(values + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    values[i] = std::exp(values[i] - shift);
    total += values[i];
  }
  return total;
}

inline float max_of(const float* values, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(best);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(values + i));
  best = _mm512_reduce_max_ps(acc);
#endif
  for (; i < n; ++i) best = std::max(best, values[i]);
  return best;
}

// float -> bf16 bits, rounding to nearest even (as c10::BFloat16).
inline void to_bf16_bits(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  for (; i + 16 <= n; i += 16) {
    __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<__m256i&>(packed));
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
