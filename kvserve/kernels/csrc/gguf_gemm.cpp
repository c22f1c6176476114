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
// - gguf_linear_q8k: the K-quants (Q4_K, Q5_K, Q6_K) with x at one step per super-block of 256
//   (llama.cpp's Q8_K): each sub-block's int32 dot times its integer scale (vpmulld; on AVX2
//   vpmaddwd against the scale), the mins or Q6_K's -32 through x's int16 code sums, the float
//   work once a super-block (superblock_panel). gguf_linear_int, the engine's entry, takes it
//   for K-quant calls of kSuperBlockMinRows rows or more (gguf_gemm.h says why).
// - gguf_linear_dequant: float activations and the exact weights, slabs of rows dequantized into
//   a scratch buffer in x's dtype and multiplied by at::linear (prefill-sized batches, the
//   exact mode); bfloat16 K-quant calls on a CPU with AMX tiles go to gguf_amx.cpp instead.
// Q4_0, Q4_1 and Q8_0 are int4_linear_q8's and int8_linear_q8's own layouts and kernels. MXFP4's
// codes go through a 16-entry byte table (one vpshufb a code vector) to e2m1 value + 12, then
// the affine path (scale d, low -12 d): 2x fewer bytes than its values as int8 (5760 x 2880 at
// one row: 0.34 ms against 0.58, Emerald Rapids).
#include "gguf_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "gguf_amx.h"
#include "gguf_codes.h"

namespace kvserve {
namespace {

// rows a pass of the Q4_K and Q5_K super-block panels: 8 (with zmm: 8 code vectors, 8 int32
// sums, the scale and the dot chains in registers); at 12, as gguf_panel, the sums spilled and
// a gate_up call ran at ~620 G multiply-adds a second against ~700 at 8 (Zen 5). Q6_K's keep
// 12: its 16 sub-block scalings a super-block made 8 rows slower (~450 against ~510-530).
constexpr int64_t kSuperBlockPass = 8;

// ---- the panels

#if KVSERVE_VEC
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

// The same over x at one step a super-block (QuantizedRows with kSuperBlockGroups), Q4_K, Q5_K
// and Q6_K: per group the unpacked codes meet each row's codes as above, but the dots are scaled
// by the sub-blocks' integer scales and summed in int32 (Kernel::add_scaled); the float work
// (steps, d, the mins or Q6_K's -32 offsets through x's int16 code sums) is once a super-block.
// The row totals live in `out` between super-blocks: 8 code vectors, 12 rows' int32 sums and
// 12 float totals would not fit 32 registers.
template <int R, typename Kernel, typename W>
void superblock_panel(const QuantizedRows& xq, int64_t m0, const uint8_t* panel, const W& w,
                      float* out) {
  using L = typename Kernel::Layout;
  for (int m = 0; m < R; ++m) w.store(out + m * 16, W::zero());
  for (int64_t g0 = 0; g0 < xq.groups; g0 += L::kGroups) {
    const uint8_t* block = panel + (g0 / L::kGroups) * L::kBytes;
    typename W::I sums[R];
    for (int m = 0; m < R; ++m) sums[m] = W::set32(0);
    for (int s = 0; s < L::kGroups; ++s) {
      if (w.leads()) prefetch_group<L>(block, s);
      typename W::I codes[8];
      unpack_group<L>(w, block, s, codes);
      Kernel::template add_scaled<R>(w, block, s, codes, xq, m0, g0 + s, sums);
    }
    const auto terms = Kernel::superblock(w, block);
    for (int m = 0; m < R; ++m) {
      float* row = out + m * 16;
      w.store(row, W::add(w.load(row), terms.value(sums[m], xq, m0 + m, g0)));
    }
  }
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

// The integer kernel of a format over a span: gguf_panel, or superblock_panel (`kSuperBlocks`:
// x quantized with kSuperBlockGroups); the scalar build's loop reads either x's codes and
// (per group, or repeated) steps.
template <typename Kernel, bool kSuperBlocks = false>
void gguf_q8(const QuantizedRows& xq, const PanelSpan& span, const at::Tensor& packed,
             int64_t out_features, const OutputRows& y) {
  auto panel_of = [&](auto r, int64_t m0, const uint8_t* panel, const auto& w, float* out) {
    if constexpr (kSuperBlocks) {
      superblock_panel<decltype(r)::value, Kernel>(xq, m0, panel, w, out);
    } else {
      gguf_panel<decltype(r)::value, Kernel>(xq, m0, panel, w, out);
    }
  };
  auto tile = [&](int block_rows, int64_t m0, const uint8_t* panel, float* out) {
#if KVSERVE_Q8_ZMM
    with_row_count(block_rows, [&](auto r) { panel_of(r, m0, panel, ZmmPanel(), out); });
#elif KVSERVE_VEC
    panel_rows(block_rows, [&](auto r, int half) { panel_of(r, m0, panel, YmmHalf{half}, out); });
#endif
  };
  auto scalar = [&](int64_t m, const uint8_t* panel, int64_t n) {
    return gguf_dot_scalar<Kernel>(xq, m, panel, n);
  };
  const int64_t panel_bytes = packed.size(1) * Kernel::Layout::kBytes;
  const bool eight = kSuperBlocks && !std::is_same_v<Kernel, Q6_KKernel>;
  run_span(xq, span, out_features, panel_bytes, packed.data_ptr<uint8_t>(), y, tile, scalar,
           eight ? kSuperBlockPass : kRowBlock);
}

PanelKernel superblock_kernel(GgufType type) {
  switch (type) {
    case GgufType::kQ4_K: return gguf_q8<KKernel<0>, true>;
    case GgufType::kQ5_K: return gguf_q8<KKernel<1>, true>;
    case GgufType::kQ6_K: return gguf_q8<Q6_KKernel, true>;
    default: return nullptr;
  }
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
        const auto terms = Kernel::group(w, block, s);
        terms.lanes(a, b);
        for (int64_t n = 0; n < rows; ++n) {
          // row n = 4 lane + r: stored positions 0..15 in halves[r], 16..31 in halves[4 + r]
          const int64_t lane = 16 * (n / 4), r = n % 4;
          const __m256i stored = _mm256_loadu2_m128i(
              reinterpret_cast<const __m128i*>(halves[4 + r] + lane),
              reinterpret_cast<const __m128i*>(halves[r] + lane));
          const __m256i q = _mm256_shuffle_epi8(stored, natural);
          const std::remove_const_t<decltype(terms)> row_terms{_mm512_set1_ps(a[n]),
                                                               _mm512_set1_ps(b[n])};
          _mm512_storeu_ps(values, group_values(
              row_terms, false, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q))));
          _mm512_storeu_ps(values + 16, group_values(
              row_terms, true, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1))));
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

at::Tensor gguf_linear_q8k(const at::Tensor& x, const at::Tensor& panels,
                           const std::string& qtype, const c10::optional<at::Tensor>& bias,
                           int64_t out_features) {
  const GgufFormat& format = gguf_format(qtype);
  check_linear(format, x, panels, bias, out_features, "gguf_linear_q8k");
  const PanelKernel kernel = superblock_kernel(format.type);
  TORCH_CHECK_VALUE(kernel != nullptr, "gguf_linear_q8k: ", qtype,
                    " has no super-blocks (Q4_K, Q5_K and Q6_K do)");
  return with_quantized_rows(x, bias, out_features, CodeOrder::kInt4Lanes, kernel, panels,
                             kSuperBlockGroups);
}

namespace {
int& superblocks_state() {  // -1: not read from KVSERVE_GGUF_SUPERBLOCKS yet, 0 off, 1 on
  static int state = -1;
  return state;
}
}  // namespace

bool gguf_superblocks_enabled() {
  int& state = superblocks_state();
  if (state < 0) {
    const char* value = std::getenv("KVSERVE_GGUF_SUPERBLOCKS");
    state = value == nullptr || std::strcmp(value, "0") != 0 ? 1 : 0;
  }
  return state == 1;
}

void set_gguf_superblocks(bool enabled) { superblocks_state() = enabled ? 1 : 0; }

bool gguf_takes_superblocks(const std::string& qtype, int64_t rows) {
  return rows >= kSuperBlockMinRows && superblock_kernel(gguf_format(qtype).type) != nullptr &&
         gguf_superblocks_enabled();
}

at::Tensor gguf_linear_int(const at::Tensor& x, const at::Tensor& panels, const std::string& qtype,
                           const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return gguf_takes_superblocks(qtype, x.size(0))
             ? gguf_linear_q8k(x, panels, qtype, bias, out_features)
             : gguf_linear_q8(x, panels, qtype, bias, out_features);
}

SpanKernel gguf_span_kernel(const std::string& qtype, int64_t rows) {
  const GgufType type = gguf_format(qtype).type;
  if (gguf_takes_superblocks(qtype, rows))
    return {superblock_kernel(type), CodeOrder::kInt4Lanes, kSuperBlockGroups};
  if (type == GgufType::kQ4_0 || type == GgufType::kQ4_1) return {int4_q8_kernel()};
  if (type == GgufType::kQ8_0) return {int8_q8_kernel(), CodeOrder::kNatural};
  return {integer_kernel(type)};
}

at::Tensor gguf_linear_dequant(const at::Tensor& x, const at::Tensor& panels,
                               const std::string& qtype, const c10::optional<at::Tensor>& bias,
                               int64_t out_features) {
  const GgufFormat& format = gguf_format(qtype);
  check_linear(format, x, panels, bias, out_features, "gguf_linear_dequant");
  if (gguf_amx_takes(qtype, x)) return gguf_linear_amx(x, panels, qtype, bias, out_features);
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
