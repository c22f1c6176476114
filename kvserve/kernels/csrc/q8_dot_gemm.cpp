// Integer-dot GEMVs for few rows: activations quantized to int8 per group of 32 (llama.cpp's
// Q8 activations), dotted with int4 (Q4_1) or int8 (Q8_0) weights by integer multiply-adds.
//
// Why: on AVX2 the float kernels (int4_gemm.cpp, int8_gemm.cpp) widen each weight to float and
// spend one FMA per weight and row: from a few rows on (decode batches, prefill) they are bound
// by those instructions (Zen 3: gate_up at 32 rows 1.2 ms here against 0.49 ms; at one row both
// run at the memory's pace, ~15 GB/s of a 21 GB/s roof, docs/performance-journal.md).
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

#include <cstring>

#include "panel_layouts.h"
#include "q8_rows.h"
#include "vec.h"

namespace kvserve {
namespace {

using namespace q8;  // QuantizedRows, run_panels, ...: the activation side, shared with gguf_gemm

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
      const __m512i dot = dot_codes<8>(_mm512_setzero_si512(), codes, x);
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
      const __m512i dot = dot_codes<8>(_mm512_set1_epi32(-128 * xq.code_sum_at(m0 + m, g)),
                                       biased, x);
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

#endif  // KVSERVE_VEC

template <typename S>
void int4_span(const QuantizedRows& xq, const PanelSpan& span, const uint8_t* packed,
               int64_t out_features, const OutputRows& y) {
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
  run_span(xq, span, out_features, panel_bytes, packed, y, tile, scalar);
}

// int4 panels with float16 (320-byte blocks) or float32 (384) metadata
void int4_q8(const QuantizedRows& xq, const PanelSpan& span, const at::Tensor& packed,
             int64_t out_features, const OutputRows& y) {
  const uint8_t* data = packed.data_ptr<uint8_t>();
  packed.size(2) == Int4Block<Half>::kBytes ? int4_span<Half>(xq, span, data, out_features, y)
                                            : int4_span<float>(xq, span, data, out_features, y);
}

void int8_q8(const QuantizedRows& xq, const PanelSpan& span, const at::Tensor& packed,
             int64_t out_features, const OutputRows& y) {
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
  run_span(xq, span, out_features, xq.groups * kInt8BlockBytes, packed.data_ptr<uint8_t>(), y,
           tile, scalar);
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
  return with_quantized_rows(x, bias, out_features, CodeOrder::kInt4Lanes, int4_q8, packed);
}

at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_x(x, "int8_linear_q8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (out_features + 15) / 16 &&
                  packed.size(1) == x.size(1) / 32 && packed.size(2) == kInt8BlockBytes,
              "int8_linear_q8: packed must be uint8 [ceil(N / 16), K / 32, 576]");
  TORCH_CHECK(!bias || bias->numel() == out_features, "int8_linear_q8: bias must be [N]");
  return with_quantized_rows(x, bias, out_features, CodeOrder::kNatural, int8_q8, packed);
}

bool q8_dot_wide() { return KVSERVE_Q8_ZMM; }

q8::PanelKernel int4_q8_kernel() { return int4_q8; }
q8::PanelKernel int8_q8_kernel() { return int8_q8; }

}  // namespace kvserve
