// lora_add_ (lora.h). The rows are sorted by slot and cut into tiles of up to kTileRows rows of
// one adapter; both products then run as small tasks in parallel:
//   shrink: h[r, w] = a[s, w, :] . x[r, :]  (register-blocked: a tile's rows x a few rows of A),
//   expand: out[r, n0:n1] += sum_w h[r, w] * b[s, w, n0:n1]  (register-blocked: a tile's rows
//           x a few vectors of outputs accumulate across w, then are added to out once; a task
//           runs up to kRunTiles tiles of one slot, bf16 columns of B converted once for them).
// The adapters' weights are small (rank x hidden per part), so the cost is the call overhead
// the torch path paid per adapter and projection; here one parallel region does each product.
#include "lora.h"

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "vec.h"

namespace kvserve {
namespace {

constexpr int64_t kTileRows = 4;
constexpr int64_t kRunTiles = 8;  // tiles of one slot per expand task
#if KVSERVE_VEC
constexpr int64_t kColumnVectors = kVecRegisters >= 32 ? 4 : 2;  // accumulators fit registers
constexpr int64_t kBlock = kColumnVectors * kLanes;
constexpr int64_t kShrinkRows = kVecRegisters >= 32 ? 4 : 2;  // A rows per x load in the shrink
#else
constexpr int64_t kShrinkRows = 1;
constexpr int64_t kBlock = 16;
#endif

struct Tile {
  int64_t slot, begin, count;  // rows order[begin, begin + count), all of `slot`
};

// The rows with an adapter, sorted by slot (stable), cut into tiles.
std::vector<Tile> tiles_by_slot(const int32_t* slots, int64_t rows, int64_t num_slots,
                                std::vector<int64_t>& order) {
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "lora_add_: row ", t, " has slot ",
                slots[t], " of ", num_slots);
    if (slots[t] >= 0) ++start[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  order.assign(start[num_slots], 0);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t b = start[s]; b < start[s + 1]; b += kTileRows)
      tiles.push_back({s, b, std::min(kTileRows, start[s + 1] - b)});
  return tiles;
}

// sums[r][j] = w_rows[j] . x_rows[r] over k values, for kTileRows rows and kShrinkRows rows of
// A (spare rows of either repeat a valid one): each loaded vector of x serves kShrinkRows rows
// of A and each of A kTileRows rows of x.
template <typename TX, typename TW>
void dot_block(const TW* const* w_rows, const TX* const* x_rows, int64_t k,
               float (*sums)[kShrinkRows]) {
  int64_t i = 0;
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t j = 0; j < kShrinkRows; ++j) sums[r][j] = 0.f;
#if KVSERVE_VEC
  vf acc[kTileRows][kShrinkRows];
  for (auto& row : acc)
    for (auto& v : row) v = vzero();
  for (; i + kLanes <= k; i += kLanes) {
    vf xv[kTileRows];
    for (int64_t r = 0; r < kTileRows; ++r) xv[r] = vload(x_rows[r] + i);
    for (int64_t j = 0; j < kShrinkRows; ++j) {
      const vf wv = vload(w_rows[j] + i);
      for (int64_t r = 0; r < kTileRows; ++r) acc[r][j] = vfma(wv, xv[r], acc[r][j]);
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t j = 0; j < kShrinkRows; ++j) sums[r][j] = vsum(acc[r][j]);
#endif
  for (; i < k; ++i)
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int64_t j = 0; j < kShrinkRows; ++j)
        sums[r][j] += static_cast<float>(w_rows[j][i]) * static_cast<float>(x_rows[r][i]);
}

// h[i, :] = a[slot] @ x[order[i]] for every sorted row i, over (tile, group of kShrinkRows rows
// of A) tasks.
template <typename TX, typename TW>
void shrink(const TX* x, int64_t k, const TW* a, int64_t width,
            const std::vector<Tile>& tiles, const std::vector<int64_t>& order, float* h) {
  const int64_t groups = (width + kShrinkRows - 1) / kShrinkRows;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * groups, 1,
                   [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Tile& tile = tiles[task / groups];
      const int64_t w0 = (task % groups) * kShrinkRows;
      const int64_t count = std::min(kShrinkRows, width - w0);
      const TX* rows[kTileRows];
      for (int64_t r = 0; r < kTileRows; ++r)
        rows[r] = x + order[tile.begin + (r < tile.count ? r : 0)] * k;
      const TW* w_rows[kShrinkRows];
      for (int64_t j = 0; j < kShrinkRows; ++j)
        w_rows[j] = a + (tile.slot * width + w0 + (j < count ? j : 0)) * k;
      float sums[kTileRows][kShrinkRows];
      dot_block(w_rows, rows, k, sums);
      for (int64_t r = 0; r < tile.count; ++r)
        for (int64_t j = 0; j < count; ++j) h[(tile.begin + r) * width + w0 + j] = sums[r][j];
    }
  });
}

inline void add_to(float* out, const float* values, int64_t n) {
  int64_t i = 0;
#if KVSERVE_VEC
  for (; i + kLanes <= n; i += kLanes) vstore(out + i, vadd(vload(out + i), vload(values + i)));
#endif
  for (; i < n; ++i) out[i] += values[i];
}

inline void add_to(c10::BFloat16* out, const float* values, int64_t n) {
  float sums[kBlock];
  int64_t i = 0;
#if KVSERVE_VEC
  for (; i + kLanes <= n; i += kLanes) vstore(sums + i, vadd(vload(out + i), vload(values + i)));
#endif
  for (; i < n; ++i) sums[i] = static_cast<float>(out[i]) + values[i];
  to_bf16_bits(sums, reinterpret_cast<uint16_t*>(out), n);
}

// acc[r, :] = sum_w h[r, w] * panel[w * stride : w * stride + n] for the tile's rows
// (n <= kBlock).
template <typename TW>
void expand_block(const float* h, int64_t width, const TW* panel, int64_t stride, int64_t n,
                  float (*acc)[kBlock]) {
#if KVSERVE_VEC
  if (n == kBlock) {
    vf sums[kTileRows][kColumnVectors];
    for (auto& row : sums)
      for (auto& v : row) v = vzero();
    for (int64_t w = 0; w < width; ++w) {
      vf bv[kColumnVectors];
      for (int64_t v = 0; v < kColumnVectors; ++v) bv[v] = vload(panel + w * stride + v * kLanes);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const vf coefficient = vset1(h[r * width + w]);
        for (int64_t v = 0; v < kColumnVectors; ++v)
          sums[r][v] = vfma(coefficient, bv[v], sums[r][v]);
      }
    }
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int64_t v = 0; v < kColumnVectors; ++v) vstore(acc[r] + v * kLanes, sums[r][v]);
    return;
  }
#endif
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t j = 0; j < n; ++j) acc[r][j] = 0.f;
  for (int64_t w = 0; w < width; ++w)
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int64_t j = 0; j < n; ++j)
        acc[r][j] += h[r * width + w] * static_cast<float>(panel[w * stride + j]);
}

// Consecutive tiles of one slot, at most kRunTiles: an expand task's rows, which share the
// columns of B it converts (bf16) once.
struct Run {
  int64_t slot, first_tile, tiles;
};

std::vector<Run> runs_of(const std::vector<Tile>& tiles) {
  std::vector<Run> runs;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    if (runs.empty() || runs.back().slot != tiles[t].slot || runs.back().tiles == kRunTiles)
      runs.push_back({tiles[t].slot, t, 0});
    ++runs.back().tiles;
  }
  return runs;
}

// out[order[i], :] += h[i, :] @ b[slot] for every sorted row i, over (run, output block) tasks.
template <typename TO, typename TW>
void expand(TO* out, int64_t n_out, const TW* b, int64_t width, const std::vector<Tile>& tiles,
            const std::vector<int64_t>& order, const float* h) {
  const int64_t blocks = (n_out + kBlock - 1) / kBlock;
  const std::vector<Run> runs = runs_of(tiles);
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * blocks, 1,
                   [&](int64_t begin, int64_t end) {
    float acc[kTileRows][kBlock];
    std::vector<float> panel;  // a bf16 run's columns of B as float32
    for (int64_t task = begin; task < end; ++task) {
      const Run& run = runs[task / blocks];
      const int64_t n0 = (task % blocks) * kBlock, n = std::min(kBlock, n_out - n0);
      const TW* columns = b + run.slot * width * n_out + n0;
      const bool convert = !std::is_same<TW, float>::value && run.tiles > 1;
      if (convert) {
        panel.resize(width * kBlock);
        for (int64_t w = 0; w < width; ++w)
          for (int64_t j = 0; j < n; ++j)
            panel[w * kBlock + j] = static_cast<float>(columns[w * n_out + j]);
      }
      for (int64_t t = run.first_tile; t < run.first_tile + run.tiles; ++t) {
        const Tile& tile = tiles[t];
        // h has kTileRows spare rows at its end, so a short tile reads (and drops) valid memory
        const float* rows = h + tile.begin * width;
        if (convert)
          expand_block(rows, width, panel.data(), kBlock, n, acc);
        else
          expand_block(rows, width, columns, n_out, n, acc);
        for (int64_t r = 0; r < tile.count; ++r)
          add_to(out + order[tile.begin + r] * n_out + n0, acc[r], n);
      }
    }
  });
}

template <typename TX, typename TW>
void lora_add_typed(const at::Tensor& x, at::Tensor& out, const at::Tensor& a,
                    const at::Tensor& b, const std::vector<Tile>& tiles,
                    const std::vector<int64_t>& order) {
  const int64_t width = a.size(1), k = a.size(2), n_out = b.size(2);
  std::vector<float> h((order.size() + kTileRows) * width, 0.f);
  shrink(x.data_ptr<TX>(), k, a.data_ptr<TW>(), width, tiles, order, h.data());
  expand(out.data_ptr<TX>(), n_out, b.data_ptr<TW>(), width, tiles, order, h.data());
}

template <typename TX>
void lora_add_weights(const at::Tensor& x, at::Tensor& out, const at::Tensor& a,
                      const at::Tensor& b, const std::vector<Tile>& tiles,
                      const std::vector<int64_t>& order) {
  if (a.scalar_type() == at::kFloat)
    lora_add_typed<TX, float>(x, out, a, b, tiles, order);
  else
    lora_add_typed<TX, c10::BFloat16>(x, out, a, b, tiles, order);
}

}  // namespace

// Runs of more than gemm_rows consecutive rows of one slot through two GEMMs; returns the
// slots the tiles still take (those runs' rows -1), or `slots` itself when no run is that long.
at::Tensor gemm_long_runs(const at::Tensor& x, at::Tensor& out, const at::Tensor& a,
                          const at::Tensor& b, const at::Tensor& slots, int64_t gemm_rows) {
  const int32_t* slot = slots.data_ptr<int32_t>();
  const int64_t rows = slots.numel();
  at::Tensor rest = slots;
  for (int64_t start = 0, end; start < rows; start = end) {
    for (end = start + 1; end < rows && slot[end] == slot[start];) ++end;
    if (slot[start] < 0 || end - start <= gemm_rows) continue;
    TORCH_CHECK(slot[start] < a.size(0), "lora_add_: row ", start, " has slot ", slot[start],
                " of ", a.size(0));
    const at::Tensor a_slot = a[slot[start]].to(x.scalar_type());
    const at::Tensor b_slot = b[slot[start]].to(x.scalar_type());
    at::Tensor target = out.narrow(0, start, end - start);
    target.addmm_(x.narrow(0, start, end - start).mm(a_slot.t()), b_slot);
    if (rest.data_ptr() == slots.data_ptr()) rest = slots.clone();
    rest.narrow(0, start, end - start).fill_(-1);
  }
  return rest;
}

void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slots, int64_t gemm_rows) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_add_: x [T, K], out [T, N], a [S, W, K], b [S, W, N]");
  TORCH_CHECK(out.is_contiguous() && a.is_contiguous() &&
                  b.is_contiguous() && slots.is_contiguous(),
              "lora_add_: contiguous tensors only");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add_: x and out float32 or bf16 alike");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_add_: a and b float32 or bf16 alike");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.numel() == x.size(0),
              "lora_add_: int32 slots, one per row");
  TORCH_CHECK(out.size(0) == x.size(0) && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                  a.size(2) == x.size(1) && b.size(2) == out.size(1),
              "lora_add_: shapes x ", x.sizes(), ", out ", out.sizes(), ", a ", a.sizes(),
              ", b ", b.sizes());
  TORCH_CHECK(gemm_rows >= 0, "lora_add_: gemm_rows >= 0");
  const at::Tensor xc = x.contiguous();  // a projection's input may be a view
  const at::Tensor rest = gemm_rows < x.size(0) ? gemm_long_runs(xc, out, a, b, slots, gemm_rows)
                                                : slots;
  std::vector<int64_t> order;
  const std::vector<Tile> tiles =
      tiles_by_slot(rest.data_ptr<int32_t>(), x.size(0), a.size(0), order);
  if (tiles.empty() || a.size(1) == 0) return;
  if (x.scalar_type() == at::kFloat)
    lora_add_weights<float>(xc, out, a, b, tiles, order);
  else
    lora_add_weights<c10::BFloat16>(xc, out, a, b, tiles, order);
}

}  // namespace kvserve
