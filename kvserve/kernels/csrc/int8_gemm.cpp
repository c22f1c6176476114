// int8 groupwise weight-only GEMM for few rows: the LM head of decode steps (a third of a
// single-stream step's bytes once the layers are 4-bit).
//
// Why: torch's _weight_int8pack_mm is per-channel only (not GGUF's Q8_0, so the head lost
// accuracy), and on AVX2-only CPUs it runs 2x slower than the float32 GEMV it replaces. Here the
// codes are widened in registers (shift left, arithmetic shift right, convert: exact) and
// multiplied in float by each x value broadcast, so the result is the float GEMV of the exact
// Q8_0 weights; the weights are read once per call whatever the row count, in one sequential,
// prefetched stream per thread. From 4 rows that is bound by float FMAs (~100 GMAC/s on 2 Zen 4
// cores: a 9-token verification's head took 2.9 ms against 0.9 at one row), so with AVX512-BF16
// and bf16 x the widened codes become bf16 pairs for vdpbf16ps, twice the multiply-adds an
// instruction, still exact products (~165 GMAC/s: 9 rows 1.7 ms).
//
// Layout (reference.py::pack_int8): output rows in panels of 16; per (panel, group of 32 along K)
// one 576-byte block: 8 chunks of 64 bytes, chunk c holding k = 4c..4c+3 of row n at bytes
// 4n..4n+3 (one 32-bit lane per row), then the 16 rows' float32 scales. AVX-512 takes a chunk as
// one vector of 16 rows; AVX2 as two halves of 8 rows.
#include "int8_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "panel_layouts.h"
#include "vec.h"

namespace kvserve {
namespace {

constexpr int64_t kGroup = kInt8Group;
constexpr int64_t kPanel = kInt8Panel;
constexpr int64_t kBlockBytes = kInt8BlockBytes;
constexpr int kRowBlock = 8;                                  // rows of x per pass over a panel

inline const float* block_scales(const uint8_t* block) { return int8_block_scales(block); }

void int8_linear_scalar(const float* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                        int64_t out_features, int64_t groups, float* y) {
  at::parallel_for(0, out_features, kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < rows; ++m) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = packed + ((n / kPanel) * groups + g) * kBlockBytes;
          float dot = 0.f;
          for (int64_t k = 0; k < kGroup; ++k) dot += int8_code_at(block, n, k) * x[m * ldx + g * kGroup + k];
          acc += dot * block_scales(block)[n % kPanel];
        }
        y[m * out_features + n] = acc;
      }
    }
  });
}

#if KVSERVE_VEC
// Lanes of one chunk (W = kLanes rows) -> byte b of each 32-bit lane as a float, sign kept.
#if KVSERVE_VEC == 16
using vi = __m512i;
inline vi load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
template <int B> inline vf code_byte(vi lanes) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lanes, 24 - 8 * B), 24));
}
#else
using vi = __m256i;
inline vi load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const vi*>(p)); }
template <int B> inline vf code_byte(vi lanes) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lanes, 24 - 8 * B), 24));
}
#endif

// out[m][part lanes] for R rows of x over one panel's `part` (AVX2: 2 parts of 8 rows). With few
// rows each row keeps several dot chains: one chain is a dependent FMA every 4 cycles, which held
// one row to half the speed.
template <int R>
void panel_part(const float* x, int64_t ldx, const uint8_t* panel, int64_t groups, int part,
                float* out) {
  constexpr int C = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  vf total[R];
  for (int m = 0; m < R; ++m) total[m] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + g * kBlockBytes;
    if (part == 0) int8_prefetch_ahead(block);
    vf dot[R][C];
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < C; ++c) dot[m][c] = vzero();
    for (int chunk = 0; chunk < 8; ++chunk) {
      const vi lanes = load_codes(block + chunk * 64 + part * kLanes * 4);
      const vf w0 = code_byte<0>(lanes), w1 = code_byte<1>(lanes);
      const vf w2 = code_byte<2>(lanes), w3 = code_byte<3>(lanes);
      const int64_t k = g * kGroup + chunk * 4;
      for (int m = 0; m < R; ++m) {
        const float* xk = x + m * ldx + k;
        dot[m][0] = vfma(w0, vset1(xk[0]), dot[m][0]);
        dot[m][1 % C] = vfma(w1, vset1(xk[1]), dot[m][1 % C]);
        dot[m][2 % C] = vfma(w2, vset1(xk[2]), dot[m][2 % C]);
        dot[m][3 % C] = vfma(w3, vset1(xk[3]), dot[m][3 % C]);
      }
    }
    const vf scale = vload(block_scales(block) + part * kLanes);
    for (int m = 0; m < R; ++m) {
      vf sum = dot[m][0];
      for (int c = 1; c < C; ++c) sum = vadd(sum, dot[m][c]);
      total[m] = vfma(sum, scale, total[m]);
    }
  }
  for (int m = 0; m < R; ++m) vstore(out + m * kPanel + part * kLanes, total[m]);
}

void panel_rows(int rows, const float* x, int64_t ldx, const uint8_t* panel, int64_t groups,
                float* out) {
  for (int part = 0; part < kPanel / kLanes; ++part) {
    switch (rows) {
#define KVSERVE_ROWS_CASE(R) \
  case R: panel_part<R>(x, ldx, panel, groups, part, out); break;
      KVSERVE_ROWS_CASE(1) KVSERVE_ROWS_CASE(2) KVSERVE_ROWS_CASE(3) KVSERVE_ROWS_CASE(4)
      KVSERVE_ROWS_CASE(5) KVSERVE_ROWS_CASE(6) KVSERVE_ROWS_CASE(7) KVSERVE_ROWS_CASE(8)
#undef KVSERVE_ROWS_CASE
      default: TORCH_CHECK(false, "int8_linear: bad row block ", rows);
    }
  }
}

#if KVSERVE_VEC == 16 && defined(__AVX512BF16__)
// bf16 x on vdpbf16ps (32 multiply-adds an instruction against the FMA's 16): a chunk's four code
// bytes per row become two vectors of bf16 pairs, (q0, q1) and (q2, q3) per 32-bit lane. An int8
// code is exact in bf16 (at most 8 significant bits), so its bf16 is the high half of its float;
// the products with bf16 x are exact in float, as in the FMA path. Two dot chains per row, one per
// pair, whatever the row count: a row's logits are the same bits in a call of 3 rows or of 12
// (calls of 1-2 rows take the FMA path, another summation order).
template <int B> inline __m512i code_float_bits(__m512i lanes) {
  return _mm512_castps_si512(code_byte<B>(lanes));
}

inline __m512i bf16_pairs(__m512i even, __m512i odd) {  // (bf16(even), bf16(odd)) per lane
  constexpr int kAndOr = 0xEA;                            // ternary logic (A & B) | C
  return _mm512_ternarylogic_epi32(odd, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)),
                                   _mm512_srli_epi32(even, 16), kAndOr);
}

inline __m512 dot_pair(__m512 acc, __m512i w, const at::BFloat16* x) {
  // x's pair as an embedded {1to16} broadcast (the intrinsic costs a separate vpbroadcastd)
  asm("vdpbf16ps %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// Up to 12 rows a pass (24 dot chains in registers; the running totals stay in the L1 tile): a
// 9-token verification reads the weights once.
constexpr int kBf16RowBlock = 12;
// Below this many rows, bound by reading the weights, the FMA path's four chains a row (latency
// 4) run ahead of these two (latency 6): 1 row 0.96 against 1.09 ms on a Zen 4.
constexpr int64_t kBf16MinRows = 3;

template <int R>
void panel_bf16(const at::BFloat16* x, int64_t ldx, const uint8_t* panel, int64_t groups,
                float* out) {
  for (int m = 0; m < R; ++m) vstore(out + m * kPanel, vzero());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + g * kBlockBytes;
    int8_prefetch_ahead(block);
    __m512 dot[R][2];
    for (int m = 0; m < R; ++m) dot[m][0] = dot[m][1] = vzero();
    for (int chunk = 0; chunk < 8; ++chunk) {
      const vi lanes = load_codes(block + chunk * 64);
      const __m512i low = bf16_pairs(code_float_bits<0>(lanes), code_float_bits<1>(lanes));
      const __m512i high = bf16_pairs(code_float_bits<2>(lanes), code_float_bits<3>(lanes));
      const int64_t k = g * kGroup + chunk * 4;
      for (int m = 0; m < R; ++m) {
        dot[m][0] = dot_pair(dot[m][0], low, x + m * ldx + k);
        dot[m][1] = dot_pair(dot[m][1], high, x + m * ldx + k + 2);
      }
    }
    const vf scale = vload(block_scales(block));
    for (int m = 0; m < R; ++m)
      vstore(out + m * kPanel,
             vfma(vadd(dot[m][0], dot[m][1]), scale, vload(out + m * kPanel)));
  }
}

void panel_rows(int rows, const at::BFloat16* x, int64_t ldx, const uint8_t* panel,
                int64_t groups, float* out) {
  switch (rows) {
#define KVSERVE_ROWS_CASE(R) \
  case R: return panel_bf16<R>(x, ldx, panel, groups, out);
    KVSERVE_ROWS_CASE(1) KVSERVE_ROWS_CASE(2) KVSERVE_ROWS_CASE(3) KVSERVE_ROWS_CASE(4)
    KVSERVE_ROWS_CASE(5) KVSERVE_ROWS_CASE(6) KVSERVE_ROWS_CASE(7) KVSERVE_ROWS_CASE(8)
    KVSERVE_ROWS_CASE(9) KVSERVE_ROWS_CASE(10) KVSERVE_ROWS_CASE(11) KVSERVE_ROWS_CASE(12)
#undef KVSERVE_ROWS_CASE
    default: TORCH_CHECK(false, "int8_linear: bad row block ", rows);
  }
}

constexpr int row_block(const at::BFloat16*) { return kBf16RowBlock; }
#endif
constexpr int row_block(const float*) { return kRowBlock; }

template <typename T>
void int8_linear_vec(const T* x, int64_t rows, int64_t ldx, const uint8_t* packed,
                     int64_t out_features, int64_t groups, float* y) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 8, [&](int64_t begin, int64_t end) {
    constexpr int kMaxBlock = row_block(static_cast<const T*>(nullptr));
    const int64_t block = rows_per_pass(rows, kMaxBlock);
    alignas(64) float tile[kMaxBlock * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t count = std::min(kPanel, out_features - p * kPanel);
      for (int64_t m0 = 0; m0 < rows; m0 += block) {
        const int block_rows = static_cast<int>(std::min<int64_t>(block, rows - m0));
        panel_rows(block_rows, x + m0 * ldx, ldx, packed + p * groups * kBlockBytes, groups,
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

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0,
              "int8_linear: x must be [M, K] with K divisible by 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear: x must be float32 or bfloat16");
  const int64_t groups = x.size(1) / kGroup;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (out_features + kPanel - 1) / kPanel &&
                  packed.size(1) == groups && packed.size(2) == kBlockBytes,
              "int8_linear: packed must be uint8 [ceil(N / 16), K / 32, 576]");
  TORCH_CHECK(!bias || bias->numel() == out_features, "int8_linear: bias must be [N]");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
#if KVSERVE_VEC == 16 && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= kBf16MinRows) {
    const at::Tensor x_bf16 = x.contiguous();
    if (out_features > 0)
      int8_linear_vec(x_bf16.data_ptr<at::BFloat16>(), x.size(0), x_bf16.stride(0),
                      packed.data_ptr<uint8_t>(), out_features, groups, y.data_ptr<float>());
    if (bias) y.add_(bias->to(at::kFloat));
    return y.to(at::kBFloat16);
  }
#endif
  // x and y in float (small next to the weights); the products are float FMAs either way
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
  if (x.size(0) > 0 && out_features > 0) {
#if KVSERVE_VEC
    int8_linear_vec(x_float.data_ptr<float>(), x.size(0), x_float.stride(0),
                    packed.data_ptr<uint8_t>(), out_features, groups, y.data_ptr<float>());
#else
    int8_linear_scalar(x_float.data_ptr<float>(), x.size(0), x_float.stride(0),
                       packed.data_ptr<uint8_t>(), out_features, groups, y.data_ptr<float>());
#endif
  }
  if (bias) y.add_(bias->to(at::kFloat));
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace kvserve
