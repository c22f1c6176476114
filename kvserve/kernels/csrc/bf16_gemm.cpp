// bf16 weight GEMM for few rows: the decoder projections and LM head of decode steps when the
// weights stay bf16 (lossless mode, or a bf16 checkpoint).
//
// Why: oneDNN's bf16 GEMM at one row read only ~7 GB/s of weights on Zen 4 (a 960 x 576 matrix
// in ~150 us), so lossless bf16 decode was 1.5x slower per token than vLLM's. Here each weight
// pair is one 32-bit lane, multiplied in place: with AVX512-BF16 by vdpbf16ps against x's pair
// broadcast (bf16 x), elsewhere split into two float vectors (a shift and a mask: exact) and
// FMA'd with each x value broadcast; the weights stream once per call whatever the row count (up
// to 8 rows of x per pass from registers), one prefetched stream per thread.
#include "bf16_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace kvserve {
namespace {

using at::BFloat16;

constexpr int64_t kGroup = 32;                    // k per block
constexpr int64_t kPanel = 16;                    // output rows per panel
constexpr int64_t kBlockBytes = kPanel * kGroup * 2;
constexpr int kRowBlock = 8;
constexpr int64_t kPrefetchBlocks = 8;            // 8 KB ahead

inline float weight_at(const uint8_t* block, int64_t n, int64_t k) {
  BFloat16 value;
  std::memcpy(&value, block + (k / 2) * 64 + (n % kPanel) * 4 + (k % 2) * 2, sizeof(value));
  return static_cast<float>(value);
}

template <typename T>
void bf16_linear_scalar(const T* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                        int64_t out_features, int64_t groups, float* y) {
  at::parallel_for(0, out_features, kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < rows; ++m) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = packed + ((n / kPanel) * groups + g) * kBlockBytes;
          for (int64_t k = 0; k < kGroup; ++k)
            acc += weight_at(block, n, k) * static_cast<float>(x[m * ldx + g * kGroup + k]);
        }
        y[m * out_features + n] = acc;
      }
    }
  });
}

#if KVSERVE_VEC
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < kBlockBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBlocks * kBlockBytes + line),
                 _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
// bf16 x: 16 rows per vector, one vdpbf16ps per (k pair, row of x), x's pair as an embedded
// broadcast from memory.
template <int R>
void panel_part(const BFloat16* x, int64_t ldx, const uint8_t* panel, int64_t groups, int,
                float* out) {
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + g * kBlockBytes;
    prefetch_ahead(block);
    for (int pair = 0; pair < kGroup / 2; ++pair) {
      const __m512i w = _mm512_loadu_si512(block + pair * 64);
      const BFloat16* xk = x + g * kGroup + 2 * pair;
      for (int m = 0; m < R; ++m) {
        asm("vdpbf16ps %2%{1to16%}, %1, %0"
            : "+v"(total[m])
            : "v"(w), "m"(*reinterpret_cast<const int32_t*>(xk + m * ldx)));
      }
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * kPanel, total[m]);
}
#endif

// float x: kLanes rows per vector (two parts of 8 rows on AVX2), pairs split into even/odd float
// vectors (bf16 -> float is a 16-bit shift), one FMA per (k, row of x).
template <int R>
void panel_part(const float* x, int64_t ldx, const uint8_t* panel, int64_t groups, int part,
                float* out) {
  vf total[R];
  for (int m = 0; m < R; ++m) total[m] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + g * kBlockBytes;
    if (part == 0) prefetch_ahead(block);
    for (int pair = 0; pair < kGroup / 2; ++pair) {
      const uint8_t* src = block + pair * 64 + part * kLanes * 4;
#if KVSERVE_VEC == 16
      const __m512i w = _mm512_loadu_si512(src);
      const vf even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      const vf odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(~0xFFFF)));
#else
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const vf even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const vf odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(~0xFFFF)));
#endif
      const float* xk = x + g * kGroup + 2 * pair;
      for (int m = 0; m < R; ++m) {
        total[m] = vfma(even, vset1(xk[m * ldx]), total[m]);
        total[m] = vfma(odd, vset1(xk[m * ldx + 1]), total[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) vstore(out + m * kPanel + part * kLanes, total[m]);
}

template <typename T>
void panel_rows(int rows, const T* x, int64_t ldx, const uint8_t* panel, int64_t groups,
                float* out) {
  constexpr int parts = std::is_same<T, float>::value ? kPanel / kLanes : 1;
  for (int part = 0; part < parts; ++part) {
    switch (rows) {
#define KVSERVE_ROWS_CASE(R) \
  case R: panel_part<R>(x, ldx, panel, groups, part, out); break;
      KVSERVE_ROWS_CASE(1) KVSERVE_ROWS_CASE(2) KVSERVE_ROWS_CASE(3) KVSERVE_ROWS_CASE(4)
      KVSERVE_ROWS_CASE(5) KVSERVE_ROWS_CASE(6) KVSERVE_ROWS_CASE(7) KVSERVE_ROWS_CASE(8)
#undef KVSERVE_ROWS_CASE
      default: TORCH_CHECK(false, "bf16_linear: bad row block ", rows);
    }
  }
}

template <typename T>
void bf16_linear_vec(const T* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                     int64_t out_features, int64_t groups, float* y) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    float tile[kRowBlock * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t count = std::min(kPanel, out_features - p * kPanel);
      for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
        const int block_rows = static_cast<int>(std::min<int64_t>(kRowBlock, rows - m0));
        panel_rows<T>(block_rows, x + m0 * ldx, ldx, packed + p * groups * kBlockBytes, groups,
                      tile);
        for (int m = 0; m < block_rows; ++m)
          std::copy(tile + m * kPanel, tile + m * kPanel + count,
                    y + (m0 + m) * out_features + p * kPanel);
      }
    }
  });
}
#endif

}  // namespace

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0,
              "bf16_linear: x must be [M, K] with K divisible by 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be float32 or bfloat16");
  const int64_t groups = x.size(1) / kGroup;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel &&
                  packed.size(1) == groups && packed.size(2) == kBlockBytes,
              "bf16_linear: packed must be uint8 [ceil(N / 16), K / 32, 1024]");
  TORCH_CHECK(!bias || bias->numel() == out_features, "bf16_linear: bias must be [N]");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  if (x.size(0) > 0 && out_features > 0) {
    float* out = y.data_ptr<float>();
    const uint8_t* weights = packed.data_ptr<uint8_t>();
#if defined(__AVX512BF16__)
    if (x.scalar_type() == at::kBFloat16) {  // bf16 dot products straight from bf16 x
      const at::Tensor xs = x.contiguous();
      bf16_linear_vec(xs.data_ptr<BFloat16>(), x.size(0), xs.stride(0), weights, out_features,
                      groups, out);
      if (bias) y.add_(bias->to(at::kFloat));
      return y.to(x.scalar_type());
    }
#endif
    // x widened to float (small next to the weights)
    const at::Tensor xs = x.to(at::kFloat).contiguous();
#if KVSERVE_VEC
    bf16_linear_vec(xs.data_ptr<float>(), x.size(0), xs.stride(0), weights, out_features, groups,
                    out);
#else
    bf16_linear_scalar(xs.data_ptr<float>(), x.size(0), xs.stride(0), weights, out_features,
                       groups, out);
#endif
  }
  if (bias) y.add_(bias->to(at::kFloat));
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace kvserve
