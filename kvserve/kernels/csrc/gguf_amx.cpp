// GGUF K-quant linear layers on AMX tiles (gguf_amx.h).
//
// Why: a prefill-sized batch (tens to hundreds of rows) through the integer-dot kernel runs at
// vpdpbusd's rate (~300 G multiply-adds a second on two Emerald Rapids cores), and the
// dequantizing path (gguf_linear_dequant) writes a bfloat16 copy of every slab and hands it to
// oneDNN, which reorders it again. AMX's tdpbf16ps does 16 x 16 x 32 multiply-adds an
// instruction. The K-quants' scales differ every 32 (or 16) values, so an int8 tile product
// would need rescaling every group (measured and dropped: docs/performance-journal.md); in
// bfloat16 the scales go into the weights as they are dequantized, and the float32 tile sums
// run over the whole of K.
//
// How: a thread takes pairs of panels (32 outputs). It dequantizes a pair's groups once into a
// tile-shaped buffer (per group and panel, 16 tile rows of 16 (k, k') pairs: the integer
// kernel's code vectors hold 4 stored positions an output, so each vector gives two tile rows),
// then runs every 32-row block of x over it: 2 x 2 product tiles summed over K. x is staged once
// as A tiles (1 KB per 16 rows and group), its columns in the stored order of each group's codes
// (a permutation within each run of 8), so the pairs of x and W meet in the tiles; rows past M
// are zero. The result: 1536 x 2048 Q4_K at 256 rows in 1.0 ms against the integer kernel's 2.7
// (docs/performance-journal.md).
#include "gguf_amx.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "gguf_codes.h"

#if KVSERVE_Q8_ZMM && defined(__AVX512BF16__) && defined(__linux__)
#define KVSERVE_AMX 1
#else
#define KVSERVE_AMX 0
#endif

namespace kvserve {
namespace {

#if KVSERVE_AMX
constexpr int kTileRows = 16;
constexpr int kPanelGroupBytes = kTileRows * 64;  // one group of one panel: a B tile

// The hardware and the kernel: AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22), then the
// tile data state granted by Linux (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool hardware_allows() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

bool switched_on() {
  const char* value = std::getenv("KVSERVE_AMX");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: float32 sums (2 row blocks x 2 panels); 4, 5: x's rows; 6, 7: the panels' values.
// Every tile 16 rows of 64 bytes.
const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = kTileRows, c.bytes_per_row[t] = 64;
    return c;
  }();
  return config;
}

// The words of a run of 8 x values in the codes' stored order: stored position p holds
// k = (0, 4, 1, 5, 2, 6, 3, 7)[p] (q8_rows.h's stored_position inverted).
const __m128i& stored_word_order() {
  static const __m128i order = _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  return order;
}

// x's rows [begin, end) into dst as A tiles: per block of 16 rows and group, the rows' 32 values
// (1 KB, in the stored order of the group's codes); rows >= M zero. Why tiles: a tile load of
// x's own rows strides K * 2 bytes, a multiple of 4 KB for K = 2048, and its 16 lines fell in one
// L1 set (1536 x 2048 at 256 rows: 2.5 ms against 1.0 with the tiles).
void stage_rows(const at::Tensor& x, uint16_t* dst, int64_t begin, int64_t end) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32;
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const __m128i order = stored_word_order();
  for (int64_t m = begin; m < end; ++m) {
    uint16_t* row = dst + (m / kTileRows) * groups * 512 + (m % kTileRows) * 32;
    const uint16_t* from = src + m * x.stride(0);
    for (int64_t g = 0; g < groups; ++g, row += 512) {
      for (int64_t k = 0; k < 32; k += 8) {
        const __m128i words = m < M
            ? _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 32 * g + k)),
                               order)
            : _mm_setzero_si128();
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + k), words);
      }
    }
  }
}

// Two float vectors as one tile row: lane n = (bf16(a[n]), bf16(b[n])), rounded as
// to_bf16_bits rounds (vcvtne2ps2bf16).
inline __m512i pair_row(__m512 a, __m512 b) {
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a low, b high
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}

// Panel `panel`'s groups as B tiles: tiles[g * stride] = group g (16 rows of 64 bytes).
template <typename Kernel>
void dequantize_panel(const uint8_t* panel, int64_t groups, uint8_t* tiles, int64_t stride) {
  using L = typename Kernel::Layout;
  const ZmmPanel w;
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + (g / L::kGroups) * L::kBytes;
    const int s = static_cast<int>(g % L::kGroups);
    __m512i codes[8];
    unpack_group<L>(w, block, s, codes);
    const auto terms = Kernel::group(w, block, s);
    __m512i* rows = reinterpret_cast<__m512i*>(tiles + g * stride);
    for (int v = 0; v < 8; ++v) {  // stored positions 4v .. 4v + 3: tile rows 2v, 2v + 1
      const __m512i c = codes[v];
      const bool second = v >= 4;  // positions 16..31
      const __m512 p0 = group_values(terms, second, _mm512_and_si512(c, byte));
      const __m512 p1 = group_values(terms, second,
                                     _mm512_and_si512(_mm512_srli_epi32(c, 8), byte));
      const __m512 p2 = group_values(terms, second,
                                     _mm512_and_si512(_mm512_srli_epi32(c, 16), byte));
      const __m512 p3 = group_values(terms, second, _mm512_srli_epi32(c, 24));
      _mm512_store_si512(rows + 2 * v, pair_row(p0, p1));
      _mm512_store_si512(rows + 2 * v + 1, pair_row(p2, p3));
    }
  }
}

// The sums of one product tile (16 rows x 16 outputs, float32) into y's rows m0.. (< M) and
// columns n0.. (< N), plus the bias, in bfloat16.
void store_tile(const float* sums, at::Tensor& y, int64_t m0, int64_t n0, const float* bias) {
  const int64_t M = y.size(0), N = y.size(1);
  const int64_t rows = std::min<int64_t>(kTileRows, M - m0);
  const int64_t cols = std::min<int64_t>(16, N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + 16 * r), b));
    _mm256_mask_storeu_epi16(out + (m0 + r) * N + n0, mask, reinterpret_cast<const __m256i&>(v));
  }
}

// Row blocks over a pair of dequantized panels: RowTiles x ColTiles product tiles summed over
// every group, then stored. Tile numbers are immediates, hence the template.
template <int RowTiles, int ColTiles>
__attribute__((target("amx-tile,amx-bf16"))) void tile_block(
    const uint16_t* xs, int64_t K, int64_t m0, const uint8_t* tiles, int64_t groups,
    at::Tensor& y, int64_t n0, const float* bias) {
  alignas(64) float sums[4][kTileRows * 16];
  const int64_t row_block = K / 32 * 512;  // staged values of 16 rows
  _tile_zero(0);
  if (ColTiles > 1) _tile_zero(1);
  if (RowTiles > 1) _tile_zero(2);
  if (RowTiles > 1 && ColTiles > 1) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = tiles + g * 2 * kPanelGroupBytes;
    const uint16_t* a = xs + m0 / kTileRows * row_block + 512 * g;
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (ColTiles > 1) {
      _tile_loadd(7, b + kPanelGroupBytes, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (RowTiles > 1) {
      _tile_loadd(5, a + row_block, 64);
      _tile_dpbf16ps(2, 5, 6);
      if (ColTiles > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  if (ColTiles > 1) _tile_stored(1, sums[1], 64);
  if (RowTiles > 1) _tile_stored(2, sums[2], 64);
  if (RowTiles > 1 && ColTiles > 1) _tile_stored(3, sums[3], 64);
  store_tile(sums[0], y, m0, n0, bias);
  if (ColTiles > 1) store_tile(sums[1], y, m0, n0 + 16, bias);
  if (RowTiles > 1) store_tile(sums[2], y, m0 + kTileRows, n0, bias);
  if (RowTiles > 1 && ColTiles > 1) store_tile(sums[3], y, m0 + kTileRows, n0 + 16, bias);
}

__attribute__((target("amx-tile"))) void load_tiles() { _tile_loadconfig(&tile_config()); }
__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

template <typename Kernel>
void linear_pairs(const uint16_t* xs, int64_t padded_rows, int64_t K, const at::Tensor& panels,
                  at::Tensor& y, const float* bias, int64_t begin, int64_t end) {
  const int64_t groups = K / 32, panel_count = panels.size(0);
  const int64_t panel_bytes = panels.size(1) * Kernel::Layout::kBytes;
  const uint8_t* data = panels.data_ptr<uint8_t>();
  thread_local at::Tensor kept;  // the pair's tiles: groups x 2 x 1 KB, reused between calls
  const int64_t bytes = groups * 2 * kPanelGroupBytes + 64;
  if (!kept.defined() || kept.numel() < bytes) kept = at::empty({bytes}, at::kByte);
  uint8_t* tiles = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(kept.data_ptr<uint8_t>()) + 63) & ~uintptr_t{63});
  load_tiles();
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t p = 2 * pair;
    const bool two = p + 1 < panel_count;
    dequantize_panel<Kernel>(data + p * panel_bytes, groups, tiles, 2 * kPanelGroupBytes);
    if (two)
      dequantize_panel<Kernel>(data + (p + 1) * panel_bytes, groups, tiles + kPanelGroupBytes,
                               2 * kPanelGroupBytes);
    for (int64_t m0 = 0; m0 < padded_rows; m0 += 2 * kTileRows) {
      const bool both_rows = m0 + kTileRows < padded_rows;
      if (both_rows && two) tile_block<2, 2>(xs, K, m0, tiles, groups, y, 16 * p, bias);
      else if (both_rows) tile_block<2, 1>(xs, K, m0, tiles, groups, y, 16 * p, bias);
      else if (two) tile_block<1, 2>(xs, K, m0, tiles, groups, y, 16 * p, bias);
      else tile_block<1, 1>(xs, K, m0, tiles, groups, y, 16 * p, bias);
    }
  }
  release_tiles();
}

using PairsKernel = void (*)(const uint16_t*, int64_t, int64_t, const at::Tensor&, at::Tensor&,
                             const float*, int64_t, int64_t);

PairsKernel pairs_kernel(GgufType type) {
  switch (type) {
    case GgufType::kQ4_K: return linear_pairs<KKernel<0>>;
    case GgufType::kQ5_K: return linear_pairs<KKernel<1>>;
    case GgufType::kQ6_K: return linear_pairs<Q6_KKernel>;
    default: return nullptr;
  }
}
#endif

int& switch_state() {  // -1: not decided yet, 0 off, 1 on
  static int state = -1;
  return state;
}

}  // namespace

bool gguf_amx_usable() {
#if KVSERVE_AMX
  static const bool hardware = hardware_allows();
  int& state = switch_state();
  if (state < 0) state = switched_on() ? 1 : 0;
  return hardware && state == 1;
#else
  return false;
#endif
}

void set_gguf_amx(bool enabled) { switch_state() = enabled ? 1 : 0; }

bool gguf_amx_takes(const std::string& qtype, const at::Tensor& x) {
#if KVSERVE_AMX
  return x.scalar_type() == at::kBFloat16 && pairs_kernel(gguf_format(qtype).type) != nullptr &&
         gguf_amx_usable();
#else
  (void)qtype, (void)x;
  return false;
#endif
}

at::Tensor gguf_linear_amx(const at::Tensor& x, const at::Tensor& panels, const std::string& qtype,
                           const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(gguf_amx_takes(qtype, x), "gguf_linear_amx: not available for ", qtype,
              " with ", x.scalar_type(), " activations on this machine");
#if KVSERVE_AMX
  const GgufFormat& format = gguf_format(qtype);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "gguf_linear_amx: x must be [M, K] rows");
  check_panels(format, panels, x.size(1), "gguf_linear_amx");
  TORCH_CHECK_VALUE(panels.size(0) == (out_features + 15) / 16, "gguf_linear_amx: ",
                    panels.size(0), " panels cannot hold ", out_features, " outputs");
  TORCH_CHECK_VALUE(!bias || bias->numel() == out_features, "gguf_linear_amx: bias must be [N]");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const int64_t padded = (M + kTileRows - 1) / kTileRows * kTileRows;
  thread_local at::Tensor staged_kept;  // x in stored order, kept between calls
  if (!staged_kept.defined() || staged_kept.numel() < padded * K)
    staged_kept = at::empty({padded * K}, at::kShort);
  auto* staged = reinterpret_cast<uint16_t*>(staged_kept.data_ptr<int16_t>());
  at::parallel_for(0, padded, 16, [&](int64_t begin, int64_t end) {
    stage_rows(x, staged, begin, end);
  });
  const at::Tensor bias_f32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_data = bias ? bias_f32.data_ptr<float>() : nullptr;
  const PairsKernel kernel = pairs_kernel(format.type);
  at::parallel_for(0, (panels.size(0) + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    kernel(staged, padded, K, panels, y, bias_data, begin, end);
  });
  return y;
#else
  (void)panels, (void)bias, (void)out_features;
  return at::Tensor();
#endif
}

}  // namespace kvserve
