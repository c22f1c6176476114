// GGUF's block formats in panels (gguf_gemm.cpp, gguf_pack.cpp; reference.py::gguf_pack writes
// the same bytes). The file's own numbers are kept: its codes, its float16 scales, its 6-bit and
// 8-bit sub-block scales, nothing re-quantized.
//
// As the int4 and int8 layouts (panel_layouts.h), a panel is 16 output rows and one block holds a
// panel's share of a file block: per (panel, super-block of 256 along K) for the K-quants, per
// (panel, group of 32) for Q5_0 and Q5_1. The low 4 bits of every code are in the int4 layout,
// per group of 32: 4 chunks of 64 bytes, word e nibble j of chunk c holding
// q[e / 2][8c + 2j + e % 2]. The kernels unpack a chunk into two code vectors as int4_linear_q8
// does, v = 2c (chunk & 0x0F) and v = 2c + 1 ((chunk >> 4) & 0x0F), so x's codes keep their
// stored order (CodeOrder::kInt4Lanes). Byte b of vector v is row b / 4's code for
// k = 8c + 4 hb + 2 (v % 2) + par, where par = (b / 2) % 2 and hb = b % 2 (lane_slot below).
//
// The bits above the 4 are bit planes laid out like the code vectors, per group of 32:
// - 1 bit (Q5_0, Q5_1, Q5_K): 64 bytes, bit v of byte b = bit 4 of byte b of vector v. Vector v's
//   bits land on bit 4 by one 16-bit shift by 4 - v (never across a byte: |4 - v| <= 4) and an
//   and with 0x10; an or merges them (AVX2: 3 ops a vector, AVX-512: the shift and a vpternlog).
//   A 64-bit mask per vector (vpmovm2b) would cost AVX2 a shuffle, an and, a compare, an and.
// - 2 bits (Q6_K): two such 64-byte planes, plane v / 4 holding vector v's bits 4-5 at bits
//   2 (v % 4) and 2 (v % 4) + 1: a shift by 4 - 2 (v % 4) and an and with 0x30.
//
// Blocks (16 rows each; float16 = the file's bits; bits per weight against the file's):
// - Q5_0  codes [256] | plane [64] | d [16] f16                                  352 B  5.5 (5.5)
// - Q5_1  codes [256] | plane [64] | d [16] f16 | m [16] f16                     384 B  6.0 (6.0)
// - Q4_K  codes [8][256] | d [16] f16 | dmin [16] f16 | scales [8][16] u8 |
//         mins [8][16] u8 (the 6-bit scales and mins unpacked, 16 rows a load)  2368 B 4.625 (4.5)
// - Q5_K  codes [8][256] | planes [8][64] | then Q4_K's metadata               2880 B 5.625 (5.5)
// - Q6_K  codes [8][256] | planes [8][2][64] | d [16] f16 |
//         scales [16][16] i8 (one per sub-block of 16)                      3360 B 6.5625 (6.5625)
// Q4_0 and Q4_1 are int4_linear_q8's layout with float16 (scale, low) = (d, -8d) and (d, m)
// (320 B, 5.0 bits), Q8_0 is int8_linear_q8's (576 B, 9.0 bits): the same kernels serve them.
// - MXFP4 (gpt-oss's experts: e2m1 codes, a power-of-two scale per 32)
//         codes [256] | d [16] f32 (the scale 2^(e - 128), any e)                 320 B  5.0 (4.25)
//   Its 4-bit codes index the e2m1 values (-12..12 in halves of the scale); the kernels turn a
//   code vector into value + 12 (0..24, kMxfp4Offset) with one byte shuffle, so w = d * u - 12 d
//   is an affine format like Q4_0's.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "panel_layouts.h"

namespace kvserve {

// One (panel, block) of a bit-plane layout: `Groups` groups of 32 along K, `HighBits` above the
// low 4 a code, then `MetaBytes` of per-row metadata. The accessors take the block as bytes,
// const (the kernels) or not (the packer), and return bytes at the same constness.
template <int Groups, int HighBits, int64_t MetaBytes> struct PlaneBlock {
  static constexpr int kGroups = Groups;
  static constexpr int kHighBits = HighBits;
  static constexpr bool kTable = false;  // the codes index kMxfp4Offset (MXFP4)
  static constexpr int64_t kPlaneBytes = 64 * HighBits;  // per group
  static constexpr int64_t kPlanes = Groups * kInt4CodeBytes;
  static constexpr int64_t kMeta = kPlanes + Groups * kPlaneBytes;
  static constexpr int64_t kBytes = kMeta + MetaBytes;

  template <typename B> static B* codes(B* block, int s) { return block + s * kInt4CodeBytes; }
  template <typename B> static B* planes(B* block, int s) {
    return block + kPlanes + s * kPlaneBytes;
  }
  // the index-th array of 16 float16 after the planes
  template <typename B> static B* halves(B* block, int index) {
    return block + kMeta + 2 * kInt4Panel * index;
  }
};

// int4_linear_q8's block with float16 metadata (Int4Block<Half>: scales, then lows): Q4_0's
// and Q4_1's
using Int4Layout = PlaneBlock<1, 0, 64>;

struct Q5_0Layout : PlaneBlock<1, 1, 32> {
  template <typename B> static B* d(B* block) { return halves(block, 0); }
};

struct Q5_1Layout : PlaneBlock<1, 1, 64> {
  template <typename B> static B* d(B* block) { return halves(block, 0); }
  template <typename B> static B* m(B* block) { return halves(block, 1); }
};

// Q4_K (HighBits 0) and Q5_K (1)
template <int HighBits> struct KLayout : PlaneBlock<8, HighBits, 64 + 2 * 8 * 16> {
  using Base = PlaneBlock<8, HighBits, 64 + 2 * 8 * 16>;
  template <typename B> static B* d(B* block) { return Base::halves(block, 0); }
  template <typename B> static B* dmin(B* block) { return Base::halves(block, 1); }
  template <typename B> static B* scales(B* block, int s) {  // group s's 16 rows
    return block + Base::kMeta + 64 + 16 * s;
  }
  template <typename B> static B* mins(B* block, int s) { return scales(block, s) + 8 * 16; }
};
using Q4_KLayout = KLayout<0>;
using Q5_KLayout = KLayout<1>;

struct Q6_KLayout : PlaneBlock<8, 2, 32 + 16 * 16> {
  template <typename B> static B* d(B* block) { return halves(block, 0); }
  // sub-block j's (16 values, half a group) 16 int8 scales
  template <typename B> static B* scales(B* block, int j) { return block + kMeta + 32 + 16 * j; }
};

// MXFP4: code q's e2m1 value (in halves of the block's scale) plus 12, ggml's table shifted to
// be unsigned (the integer dots multiply unsigned weight bytes by signed activation codes).
constexpr uint8_t kMxfp4Offset[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                      12, 11, 10, 9, 8, 6, 4, 0};

struct Mxfp4Layout : PlaneBlock<1, 0, 64> {
  static constexpr bool kTable = true;
  template <typename B> static B* d(B* block) { return block + kMeta; }  // 16 float32
};

// Entry n of a float16 array given as bytes, as float.
inline float half_at(const uint8_t* halves, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, halves + 2 * (n % kInt4Panel), sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Where the code of w[n, k] (n within the panel, k within a group) sits: byte `byte` of code
// vector `vector` (see the top of this file).
struct LaneSlot {
  int byte, vector;
};
inline LaneSlot lane_slot(int64_t n, int k) {
  const int chunk = k / 8, par = k % 2, hb = (k / 4) % 2, h = (k / 2) % 2;
  return {static_cast<int>(4 * (n % kInt4Panel)) + 2 * par + hb, 2 * chunk + h};
}

// The k (within the group) whose code is byte 4n + i of code vector v, any row n: lane_slot's
// inverse.
constexpr int lane_k(int i, int v) { return 8 * (v / 2) + 4 * (i % 2) + 2 * (v % 2) + i / 2; }

// The code of w[n, k] in group s of a block, high bits included (the scalar loops).
template <typename L> int code_at(const uint8_t* block, int s, int64_t n, int k) {
  int code = int4_code_at(L::codes(block, s), n, k);
  if (L::kHighBits > 0) {
    const LaneSlot slot = lane_slot(n, k);
    const int plane = slot.vector * L::kHighBits / 8, shift = slot.vector * L::kHighBits % 8;
    const int bits = L::planes(block, s)[64 * plane + slot.byte] >> shift;
    code |= (bits & ((1 << L::kHighBits) - 1)) << 4;
  }
  return code;
}

// The GGUF types with panel layouts: the file's block (values, bytes) and the panel block's bytes.
enum class GgufType { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kMXFP4 };

struct GgufFormat {
  const char* name;  // gguf's GGMLQuantizationType name
  GgufType type;
  int64_t block_values, block_bytes;  // one file block
  int64_t panel_block_bytes;          // one (panel, file block) of the layout
};

// The format named `qtype` ("Q4_K", ...); an error listing the supported names otherwise.
const GgufFormat& gguf_format(const std::string& qtype);

// An error naming `op`, the format and the sizes unless `panels` are gguf_pack's for K = cols.
void check_panels(const GgufFormat& format, const at::Tensor& panels, int64_t cols,
                  const char* op);

// Rows rows[i] (or first + i where rows is null) of checked panels, dequantized into out
// ([count, K], float32 or bfloat16) as gguf.quants.dequantize computes them; parallel.
void dequantize_panel_rows(const GgufFormat& format, const at::Tensor& panels,
                           const int64_t* rows, int64_t first, at::Tensor& out);

}  // namespace kvserve
