// The weight panel layouts shared by the float and the integer-dot kernels (int4_gemm.cpp,
// int8_gemm.cpp, q8_dot_gemm.cpp); reference.py::pack_int4 / pack_int8 write them.
//
// Both put 16 output rows in a panel and cut K into groups of 32: one block per (panel, group).
// - int4 (Q4_1-like, w = (q - 8) * scale + zero): 256 bytes of codes, 4 chunks of 64 bytes =
//   32 little-endian 16-bit words; word e, nibble j of chunk c holds q[e / 2][8c + 2j + e % 2];
//   then the 16 rows' scales, then their zeros (bf16 or float: 320 or 384 bytes). The integer-dot
//   kernel (q8_dot_gemm.cpp) keeps lows there instead of zeros (w = q * scale + low), in float16
//   or float.
// - int8 (GGUF Q8_0, w = q * scale): 8 chunks of 64 bytes, chunk c holding k = 4c..4c+3 of row n
//   at bytes 4n..4n+3; then the 16 rows' float32 scales (576 bytes).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace kvserve {

constexpr int64_t kInt4Group = 32;                           // quantization group along K
constexpr int64_t kInt4Panel = 16;                           // output rows per panel
constexpr int64_t kInt4CodeBytes = kInt4Panel * kInt4Group / 2;  // codes per block
constexpr int64_t kInt4ChunkBytes = 64;                      // one load: 4 k-pairs of the panel
// Blocks prefetched ahead (~10 KB): each call starts new streams, which the hardware prefetcher
// picks up late (measured at one row: gate_up 26 -> 19 us, qkv 11.8 -> 9.4 us; 8 or 16 blocks
// ahead gain less, 48 or 64 no more).
constexpr int64_t kInt4PrefetchBlocks = 32;

// One int4 (panel, group) block: codes, then the 16 scales, then the 16 zeros (the integer-dot
// kernel's lows), in S (float, bf16 or, for that kernel, float16).
template <typename S> struct Int4Block {
  static constexpr int64_t kBytes = kInt4CodeBytes + 2 * kInt4Panel * sizeof(S);
  static const S* scales(const uint8_t* block) {
    return reinterpret_cast<const S*>(block + kInt4CodeBytes);
  }
  static const S* zeros(const uint8_t* block) { return scales(block) + kInt4Panel; }
};

// The code of w[n, k] (n within the panel, k within the block's group), for scalar loops.
inline int int4_code_at(const uint8_t* block, int64_t n, int64_t k) {
  const int64_t chunk = k / 8, j = (k % 8) / 2, word = 2 * (n % kInt4Panel) + k % 2;
  uint16_t bits;
  std::memcpy(&bits, block + chunk * kInt4ChunkBytes + 2 * word, sizeof(bits));
  return (bits >> (4 * j)) & 0xF;
}

#if KVSERVE_VEC
template <typename S> inline void int4_prefetch_block(const uint8_t* block) {
  for (int64_t line = 0; line < Int4Block<S>::kBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + line), _MM_HINT_T0);
}
#endif

// Rows of x per pass over a panel when a pass takes at most `max_rows`: passes of equal size
// (13 rows at 12 as 7 + 6, not 12 + 1), since each pass pays the panel's unpacking whole.
inline int64_t rows_per_pass(int64_t rows, int64_t max_rows) {
  const int64_t passes = (rows + max_rows - 1) / max_rows;
  return passes ? (rows + passes - 1) / passes : max_rows;
}

constexpr int64_t kInt8Group = 32;
constexpr int64_t kInt8Panel = 16;
constexpr int64_t kInt8CodeBytes = kInt8Panel * kInt8Group;        // 512
constexpr int64_t kInt8BlockBytes = kInt8CodeBytes + kInt8Panel * 4;  // + float32 scales
constexpr int64_t kInt8PrefetchBlocks = 16;                         // ~9 KB ahead

#if KVSERVE_VEC
// The int8 block kInt8PrefetchBlocks after `block` into L1 (the kernels stream blocks in order).
inline void int8_prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < kInt8BlockBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kInt8PrefetchBlocks * kInt8BlockBytes
                                               + line), _MM_HINT_T0);
}
#endif

inline const float* int8_block_scales(const uint8_t* block) {
  return reinterpret_cast<const float*>(block + kInt8CodeBytes);
}

inline int int8_code_at(const uint8_t* block, int64_t n, int64_t k) {
  return static_cast<int8_t>(block[(k / 4) * 64 + (n % kInt8Panel) * 4 + k % 4]);
}

}  // namespace kvserve
