// GGUF tensors into panels (gguf_layouts.h) and back to the file's values.
//
// Packing is a pass over the whole model at load (a 4.7 GB Q4_K_M file must take seconds on 2
// cores), so in vector builds a row's group of 32 codes is one ymm: decoded from the file's
// nibbles and bits in a few instructions, then put into the layout by byte shuffles (the codes'
// lanes) and vpmovmskb (the bit planes) instead of 32 byte loops (measured 3-8x slower). Each
// (panel, file block) is written whole while it is in L1: every byte of it belongs to exactly
// one of its 16 rows, so no zeroing pass precedes it (only a last, partial panel is zeroed).
//
// Dequantizing gives gguf.quants.dequantize's float32 values to the bit: the same float
// operations in the same order per format (Q4_K: (d * sc) * q - (dmin * m)), never fused
// (-ffp-contract=off), then a cast to bfloat16 where asked (round to nearest even).
#include "gguf_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "gguf_layouts.h"
#include "panel_layouts.h"
#include "vec.h"

namespace kvserve {
namespace {

using at::Half;

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A metadata byte as float (through int: GCC's unsigned-to-float conversion kept a false
// dependency that stalled the dequantizing loops).
float byte_float(uint8_t v) { return static_cast<float>(static_cast<int>(v)); }
float byte_float(int8_t v) { return static_cast<float>(static_cast<int>(v)); }

float f16_to_float(uint16_t bits) { return static_cast<float>(Half(bits, Half::from_bits())); }

// ---- the file's blocks -> Codes: a row's 32 codes of a group, k order, one a byte (a ymm in
// vector builds: the steps below are then a few instructions, not 32 byte loops)

#if KVSERVE_VEC
using Codes = __m256i;

// Elements j < 16 in the low nibbles of qs[j], j >= 16 in the high nibbles of qs[j - 16]
// (Q4_0, Q4_1, Q5_0, Q5_1).
Codes split_nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                          _mm_and_si128(bytes, low4));
}

// The low (shift 0) or high (shift 4) nibbles of 32 bytes (the K-quants' sub-blocks).
Codes nibbles_of(const uint8_t* bytes, int shift) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(0x0F));
}

// q | ((bytes[k] >> shift) & mask) << 4: Q5_K's and Q6_K's high bits, a byte per element.
Codes with_high_bits(Codes q, const uint8_t* bytes, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)),
                                        _mm256_set1_epi8(static_cast<char>(mask)));
  return _mm256_or_si256(q, _mm256_slli_epi16(bits, 4));
}

// Q5_0/Q5_1's fifth bits: bit j of the little-endian 32-bit qh is element j's (byte j / 8 to
// element j, then a test of bit j % 8).
Codes with_fifth_bits(Codes q, const uint8_t* qh) {
  uint32_t word;
  std::memcpy(&word, qh, sizeof(word));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(word)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}
#else
struct Codes {
  uint8_t q[32];
};

Codes split_nibbles(const uint8_t* qs) {
  Codes codes;
  for (int j = 0; j < 16; ++j) {
    codes.q[j] = qs[j] & 0x0F;
    codes.q[j + 16] = qs[j] >> 4;
  }
  return codes;
}

Codes nibbles_of(const uint8_t* bytes, int shift) {
  Codes codes;
  for (int k = 0; k < 32; ++k) codes.q[k] = (bytes[k] >> shift) & 0x0F;
  return codes;
}

Codes with_high_bits(Codes codes, const uint8_t* bytes, int shift, int mask) {
  for (int k = 0; k < 32; ++k) codes.q[k] |= ((bytes[k] >> shift) & mask) << 4;
  return codes;
}

Codes with_fifth_bits(Codes codes, const uint8_t* qh) {
  for (int j = 0; j < 32; ++j) codes.q[j] |= ((qh[j / 8] >> (j % 8)) & 1) << 4;
  return codes;
}
#endif

// ---- codes -> the layout, row n of a block

#if KVSERVE_VEC
// A 32-byte shuffle control, made at compile time: byte p = index(p), -1 for zero.
struct alignas(32) ByteTable {
  int8_t bytes[32];
  __m256i load() const { return _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes)); }
};
template <typename Index> constexpr ByteTable byte_table(Index index) {
  ByteTable table{};
  for (int p = 0; p < 32; ++p) table.bytes[p] = static_cast<int8_t>(index(p));
  return table;
}

// put_codes's: the chunks' low (v = 2c) and high (2c + 1) nibbles in their lane bytes
constexpr ByteTable kLowNibbles = byte_table([](int p) {
  return p % 16 < 8 ? lane_k(p % 4, 2 * (p % 16 / 4)) : -1;
});
constexpr ByteTable kHighNibbles = byte_table([](int p) {
  return p % 16 < 8 ? lane_k(p % 4, 2 * (p % 16 / 4) + 1) : -1;
});
// put_high_bits<1>'s: byte 8i + v from k = lane_k(i, v), in the low or the high 16
constexpr ByteTable kBitsFromLow = byte_table([](int p) {
  const int k = lane_k(p / 8, p % 8);
  return k < 16 ? k : -1;
});
constexpr ByteTable kBitsFromHigh = byte_table([](int p) {
  const int k = lane_k(p / 8, p % 8);
  return k >= 16 ? k - 16 : -1;
});
// put_high_bits<2>'s: bytes 8i + 2v' and 8i + 2v' + 1 from vector v' (4 + v') of the low (high) 16
constexpr ByteTable kBitPairs = byte_table([](int p) { return lane_k(p / 8, p % 8 / 2); });

// Low 4 bits of q (32 codes, k order) into the int4 layout: per chunk c the row's 32-bit lane
// holds the nibbles of vectors 2c (low) and 2c + 1 (high) at its bytes i (lane_k). vpshufb
// works per 128-bit lane, holding chunks 0-1 (2-3): each gives 8 bytes.
inline void put_codes(uint8_t* codes, int64_t n, __m256i q) {
  const __m256i nibbles = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
  const __m256i lanes = _mm256_or_si256(
      _mm256_shuffle_epi8(nibbles, kLowNibbles.load()),
      _mm256_slli_epi16(_mm256_shuffle_epi8(nibbles, kHighNibbles.load()), 4));
  const uint64_t halves[2] = {static_cast<uint64_t>(_mm256_extract_epi64(lanes, 0)),
                              static_cast<uint64_t>(_mm256_extract_epi64(lanes, 2))};
  for (int c = 0; c < 4; ++c)
    std::memcpy(codes + c * kInt4ChunkBytes + 4 * (n % kInt4Panel),
                reinterpret_cast<const uint8_t*>(halves) + 4 * c, 4);
}

// The bits of q above the low 4 into row n's 4 bytes of each plane: the codes gathered in plane
// bit order (byte 8i + bit of the plane's byte i), each bit shifted onto bit 7, vpmovmskb.
template <int HighBits> inline void put_high_bits(uint8_t* planes, int64_t n, __m256i q) {
  const __m256i low_half = _mm256_permute2x128_si256(q, q, 0x00);   // k 0..15 in both lanes
  const __m256i high_half = _mm256_permute2x128_si256(q, q, 0x11);  // k 16..31
  uint32_t bits[HighBits];
  if constexpr (HighBits == 1) {  // bit v of byte i: vector v, k anywhere in 0..31
    const __m256i gathered = _mm256_or_si256(_mm256_shuffle_epi8(low_half, kBitsFromLow.load()),
                                             _mm256_shuffle_epi8(high_half, kBitsFromHigh.load()));
    bits[0] = _mm256_movemask_epi8(_mm256_slli_epi16(gathered, 3));
  } else {  // bits 2v', 2v' + 1 of plane j's byte i: vector 4j + v', k in 16j..16j+15
    const __m256i order = kBitPairs.load();
    const __m256i even = _mm256_set1_epi16(0x0080), odd = _mm256_set1_epi16(-0x8000);
    for (int j = 0; j < 2; ++j) {
      const __m256i gathered = _mm256_shuffle_epi8(j ? high_half : low_half, order);
      bits[j] = _mm256_movemask_epi8(
          _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(gathered, 3), even),
                          _mm256_and_si256(_mm256_slli_epi16(gathered, 2), odd)));
    }
  }
  for (int plane = 0; plane < HighBits; ++plane)
    std::memcpy(planes + 64 * plane + 4 * (n % kInt4Panel), &bits[plane], 4);
}
#else
// The portable loops: the same bytes, code by code.
void put_codes(uint8_t* codes, int64_t n, const Codes& row) {
  const uint8_t* q = row.q;
  for (int k = 0; k < 32; ++k) {
    const LaneSlot slot = lane_slot(n, k);
    uint8_t& byte = codes[slot.vector / 2 * kInt4ChunkBytes + slot.byte];
    byte = (slot.vector % 2 ? byte & 0x0F : byte & 0xF0) | (q[k] & 0x0F) << (4 * (slot.vector % 2));
  }
}

template <int HighBits> void put_high_bits(uint8_t* planes, int64_t n, const Codes& row) {
  const uint8_t* q = row.q;
  uint8_t bytes[HighBits][4] = {};
  for (int k = 0; k < 32; ++k) {
    const LaneSlot slot = lane_slot(n, k);
    const int bit = slot.vector * HighBits;
    bytes[bit / 8][slot.byte % 4] |= static_cast<uint8_t>((q[k] >> 4) << (bit % 8));
  }
  for (int plane = 0; plane < HighBits; ++plane)
    std::memcpy(planes + 64 * plane + 4 * (n % kInt4Panel), bytes[plane], 4);
}
#endif

// Row n's codes of group s into the block.
template <typename L> void put_group(uint8_t* block, int s, int64_t n, const Codes& codes) {
  put_codes(L::codes(block, s), n, codes);
  if constexpr (L::kHighBits > 0) put_high_bits<L::kHighBits>(L::planes(block, s), n, codes);
}

// Row n's 32 codes of group s (k order, high bits included).
template <typename L> void row_codes(const uint8_t* block, int s, int64_t n, uint8_t q[32]) {
#if KVSERVE_VEC
  // the row's 4 bytes of each chunk: low nibbles are k (0, 4, 1, 5) of the chunk, high nibbles
  // (2, 6, 3, 7); interleaved that is (0, 2, 4, 6, 1, 3, 5, 7), which one shuffle puts in order
  // (loaded a lane at a time into the vector: one load of 4 stored words stalls on forwarding)
  const int64_t lane = 4 * (n % kInt4Panel);
  const uint8_t* codes = L::codes(block, s) + lane;
  __m128i bytes = _mm_cvtsi32_si128(load_u32(codes));
  bytes = _mm_insert_epi32(bytes, static_cast<int>(load_u32(codes + kInt4ChunkBytes)), 1);
  bytes = _mm_insert_epi32(bytes, static_cast<int>(load_u32(codes + 2 * kInt4ChunkBytes)), 2);
  bytes = _mm_insert_epi32(bytes, static_cast<int>(load_u32(codes + 3 * kInt4ChunkBytes)), 3);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m128i low = _mm_and_si128(bytes, low4);                      // vectors 2c, byte 4c + i
  __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);  // vectors 2c + 1
  if constexpr (L::kHighBits == 1) {  // vector v's bit is bit v of the plane byte
    const __m128i spread = _mm_set1_epi32(static_cast<int>(load_u32(L::planes(block, s) + lane)));
    const __m128i low_bit = _mm_setr_epi8(1, 1, 1, 1, 4, 4, 4, 4, 16, 16, 16, 16, 64, 64, 64, 64);
    const __m128i high_bit = _mm_slli_epi16(low_bit, 1);
    const __m128i fifth = _mm_set1_epi8(0x10);
    low = _mm_or_si128(low, _mm_and_si128(
        _mm_cmpeq_epi8(_mm_and_si128(spread, low_bit), low_bit), fifth));
    high = _mm_or_si128(high, _mm_and_si128(
        _mm_cmpeq_epi8(_mm_and_si128(spread, high_bit), high_bit), fifth));
  } else if constexpr (L::kHighBits == 2) {  // vector v's bits at 2 (v % 4) of plane v / 4
    const int first = static_cast<int>(load_u32(L::planes(block, s) + lane));
    const int second = static_cast<int>(load_u32(L::planes(block, s) + 64 + lane));
    const __m128i spread = _mm_setr_epi32(first, first, second, second);
    const __m128i two = _mm_set1_epi8(0x03);
    // chunks 0, 2: shifts 0 (low) and 2 (high); chunks 1, 3: 4 and 6
    const __m128i low_bits = _mm_blend_epi16(spread, _mm_srli_epi16(spread, 4), 0xCC);
    const __m128i high_bits = _mm_blend_epi16(_mm_srli_epi16(spread, 2),
                                              _mm_srli_epi16(spread, 6), 0xCC);
    low = _mm_or_si128(low, _mm_slli_epi16(_mm_and_si128(low_bits, two), 4));
    high = _mm_or_si128(high, _mm_slli_epi16(_mm_and_si128(high_bits, two), 4));
  }
  const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  // one 32-byte store: two 16-byte ones stalled the wider loads of the loops reading q
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_set_m128i(
      _mm_shuffle_epi8(_mm_unpackhi_epi8(low, high), order),
      _mm_shuffle_epi8(_mm_unpacklo_epi8(low, high), order)));
#else
  for (int k = 0; k < 32; ++k) q[k] = static_cast<uint8_t>(code_at<L>(block, s, n, k));
#endif
}

// ---- the formats: pack(raw, block, n) writes row n (0..15) of a block from the row's file
// block and returns whether it fits the layout; dequantize(block, n, out) writes the block's
// block_values values of row n (any row of the panel's) as gguf.quants.dequantize computes them.

// Q4_0, Q4_1, Q5_0, Q5_1: d f16, m f16 (WithMin), qh u32 (Q5), qs[16]; w = d * (q - 8) or
// d * (q - 16), or w = d * q + m. The layouts hold d and then m; Q4_0's is int4_linear_q8's,
// whose second array is the low, -8d: exact in float16 while |d| <= 8188.
template <typename L, bool WithMin> struct SmallFormat {
  using Layout = L;
  static constexpr int kOffset = 8 << L::kHighBits;
  static constexpr int kQs = 2 + 2 * WithMin + 4 * L::kHighBits;

  static bool pack(const uint8_t* raw, uint8_t* block, int64_t n) {
    Codes codes = split_nibbles(raw + kQs);
    if constexpr (L::kHighBits > 0) codes = with_fifth_bits(codes, raw + kQs - 4);
    put_group<L>(block, 0, n, codes);
    const uint16_t d = load_u16(raw);
    store_u16(L::halves(block, 0) + 2 * n, d);
    if constexpr (WithMin) store_u16(L::halves(block, 1) + 2 * n, load_u16(raw + 2));
    if constexpr (!WithMin && L::kHighBits == 0) {
      const float exact = -8.f * f16_to_float(d);
      const Half low(exact);
      store_u16(L::halves(block, 1) + 2 * n, low.x);
      return static_cast<float>(low) == exact || std::isnan(exact);
    }
    return true;
  }
  static void dequantize(const uint8_t* block, int64_t n, float* out) {
    uint8_t q[32];
    row_codes<L>(block, 0, n, q);
    const float d = half_at(L::halves(block, 0), n);
    if constexpr (WithMin) {
      const float m = half_at(L::halves(block, 1), n);
      for (int k = 0; k < 32; ++k) out[k] = d * static_cast<float>(q[k]) + m;
    } else {
      for (int k = 0; k < 32; ++k) out[k] = d * static_cast<float>(q[k] - kOffset);
    }
  }
};
using Q4_0Format = SmallFormat<Int4Layout, false>;
using Q4_1Format = SmallFormat<Int4Layout, true>;
using Q5_0Format = SmallFormat<Q5_0Layout, false>;
using Q5_1Format = SmallFormat<Q5_1Layout, true>;

struct Q8_0Format {
  // d f16, qs[32] int8; w = q * d. The int8 layout: chunk c holds k = 4c..4c+3 of row n at
  // bytes 4n..4n+3, then float32 scales.
  static bool pack(const uint8_t* raw, uint8_t* block, int64_t n) {
    for (int c = 0; c < 8; ++c) std::memcpy(block + c * 64 + 4 * n, raw + 2 + 4 * c, 4);
    const float d = f16_to_float(load_u16(raw));
    std::memcpy(block + kInt8CodeBytes + 4 * n, &d, sizeof(d));
    return true;
  }
  static void dequantize(const uint8_t* block, int64_t n, float* out) {
    const float d = int8_block_scales(block)[n % kInt8Panel];
    alignas(32) int8_t q[32];
#if KVSERVE_VEC  // the row's lane of each chunk as one vector: one store, read back whole
    const uint8_t* lane = block + 4 * (n % kInt8Panel);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), _mm256_setr_epi32(
        load_u32(lane), load_u32(lane + 64), load_u32(lane + 128), load_u32(lane + 192),
        load_u32(lane + 256), load_u32(lane + 320), load_u32(lane + 384), load_u32(lane + 448)));
#else
    for (int k = 0; k < 32; ++k) q[k] = static_cast<int8_t>(int8_code_at(block, n, k));
#endif
    for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(q[k]) * d;
  }
};

// MXFP4: e (an E8M0 exponent), qs[16] (element j < 16 in qs[j]'s low nibble, j >= 16 in
// qs[j - 16]'s high one, as Q4_0); w = value(q) * 2^(e - 128) (ggml's e8m0 half-scale,
// denormal for e < 2), value(q) = kMxfp4Offset[q] - 12. The codes as stored, d as float32.
struct Mxfp4Format {
  using Layout = Mxfp4Layout;
  static bool pack(const uint8_t* raw, uint8_t* block, int64_t n) {
    put_group<Layout>(block, 0, n, split_nibbles(raw + 1));
    const float d = std::ldexp(1.f, static_cast<int>(raw[0]) - 128);
    std::memcpy(Layout::d(block) + 4 * (n % kInt4Panel), &d, sizeof(d));
    return true;
  }
  static void dequantize(const uint8_t* block, int64_t n, float* out) {
    uint8_t q[32];
    row_codes<Layout>(block, 0, n, q);
    float d;
    std::memcpy(&d, Layout::d(block) + 4 * (n % kInt4Panel), sizeof(d));
    for (int k = 0; k < 32; ++k)
      out[k] = d * static_cast<float>(static_cast<int>(kMxfp4Offset[q[k]]) - 12);
  }
};

// Q4_K and Q5_K: d f16, dmin f16, 12 bytes of 6-bit scales and mins (gguf's get_scale_min), then
// Q5_K's qh[32] (bit s of qh[l]: element l of sub-block s), then qs[128] (sub-block s: the
// nibbles s % 2 of qs[32 (s / 2) ..]); w = (d * sc) * q - (dmin * m).
template <int HighBits> struct KFormat {
  using Layout = KLayout<HighBits>;
  static constexpr int64_t kQs = 16 + 32 * HighBits;

  static bool pack(const uint8_t* raw, uint8_t* block, int64_t n) {
    const uint8_t* packed = raw + 4;  // d[0:4], m[4:8], m_d[8:12]
    for (int s = 0; s < 8; ++s) {
      Codes codes = nibbles_of(raw + kQs + 32 * (s / 2), 4 * (s % 2));
      if constexpr (HighBits == 1) codes = with_high_bits(codes, raw + 16, s, 1);
      put_group<Layout>(block, s, n, codes);
      const int i = s % 4;
      const bool low = s < 4;
      Layout::scales(block, s)[n] = low ? packed[i] & 0x3F
                                        : (packed[8 + i] & 0x0F) | ((packed[i] >> 2) & 0x30);
      Layout::mins(block, s)[n] = low ? packed[4 + i] & 0x3F
                                      : (packed[8 + i] >> 4) | ((packed[4 + i] >> 2) & 0x30);
    }
    store_u16(Layout::d(block) + 2 * n, load_u16(raw));
    store_u16(Layout::dmin(block) + 2 * n, load_u16(raw + 2));
    return true;
  }
  static void dequantize(const uint8_t* block, int64_t n, float* out) {
    const float d = half_at(Layout::d(block), n), dmin = half_at(Layout::dmin(block), n);
    for (int s = 0; s < 8; ++s) {
      uint8_t q[32];
      row_codes<Layout>(block, s, n, q);
      const float scale = d * byte_float(Layout::scales(block, s)[n % kInt4Panel]);
      const float low = dmin * byte_float(Layout::mins(block, s)[n % kInt4Panel]);
      for (int k = 0; k < 32; ++k) out[32 * s + k] = scale * static_cast<float>(q[k]) - low;
    }
  }
};

// Q6_K: ql[128], qh[64], scales[16] int8, d f16. Group g of 32 (half h = g / 4, s = g % 4): low
// nibbles s / 2 of ql[64h + 32 (s % 2) ..], bits 2s..2s+1 of qh[32h ..]; w = (d * sc) * (q - 32)
// with one scale per 16.
struct Q6_KFormat {
  using Layout = Q6_KLayout;
  static bool pack(const uint8_t* raw, uint8_t* block, int64_t n) {
    for (int g = 0; g < 8; ++g) {
      const int h = g / 4, s = g % 4;
      const Codes low = nibbles_of(raw + 64 * h + 32 * (s % 2), 4 * (s / 2));
      put_group<Layout>(block, g, n, with_high_bits(low, raw + 128 + 32 * h, 2 * s, 3));
    }
    for (int j = 0; j < 16; ++j) Layout::scales(block, j)[n] = raw[192 + j];
    store_u16(Layout::d(block) + 2 * n, load_u16(raw + 208));
    return true;
  }
  static float scale_at(const uint8_t* block, int j, int64_t n) {  // sub-block j's, row n's
    return byte_float(static_cast<int8_t>(Layout::scales(block, j)[n % kInt4Panel]));
  }
  static void dequantize(const uint8_t* block, int64_t n, float* out) {
    const float d = half_at(Layout::d(block), n);
    for (int g = 0; g < 8; ++g) {
      uint8_t q[32];
      row_codes<Layout>(block, g, n, q);
      const float first = d * scale_at(block, 2 * g, n), second = d * scale_at(block, 2 * g + 1, n);
      for (int k = 0; k < 32; ++k)
        out[32 * g + k] = (k < 16 ? first : second) * static_cast<float>(q[k] - 32);
    }
  }
};

void prefetch(const uint8_t* from, int64_t bytes) {
#if KVSERVE_VEC
  for (int64_t line = 0; line < bytes + 63; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(from + line), _MM_HINT_T0);
#endif
}

template <typename Fn> void with_format(GgufType type, Fn fn) {
  switch (type) {
    case GgufType::kQ4_0: return fn(Q4_0Format());
    case GgufType::kQ4_1: return fn(Q4_1Format());
    case GgufType::kQ5_0: return fn(Q5_0Format());
    case GgufType::kQ5_1: return fn(Q5_1Format());
    case GgufType::kQ8_0: return fn(Q8_0Format());
    case GgufType::kQ4_K: return fn(KFormat<0>());
    case GgufType::kQ5_K: return fn(KFormat<1>());
    case GgufType::kQ6_K: return fn(Q6_KFormat());
    case GgufType::kMXFP4: return fn(Mxfp4Format());
  }
}

constexpr GgufFormat kFormats[] = {
    {"Q4_0", GgufType::kQ4_0, 32, 18, Int4Layout::kBytes},
    {"Q4_1", GgufType::kQ4_1, 32, 20, Int4Layout::kBytes},
    {"Q5_0", GgufType::kQ5_0, 32, 22, Q5_0Layout::kBytes},
    {"Q5_1", GgufType::kQ5_1, 32, 24, Q5_1Layout::kBytes},
    {"Q8_0", GgufType::kQ8_0, 32, 34, kInt8BlockBytes},
    {"Q4_K", GgufType::kQ4_K, 256, 144, Q4_KLayout::kBytes},
    {"Q5_K", GgufType::kQ5_K, 256, 176, Q5_KLayout::kBytes},
    {"Q6_K", GgufType::kQ6_K, 256, 210, Q6_KLayout::kBytes},
    {"MXFP4", GgufType::kMXFP4, 32, 17, Mxfp4Layout::kBytes},
};

// The file's rows into panels (parallel over panels); false if a block does not fit the layout.
template <typename Format>
bool pack_panels(const uint8_t* raw, int64_t rows, int64_t row_bytes, const GgufFormat& format,
                 uint8_t* out, int64_t blocks) {
  const int64_t panels = (rows + kInt4Panel - 1) / kInt4Panel;
  const int64_t panel_bytes = blocks * format.panel_block_bytes;
  // the next panel's rows: 16 streams of small steps, which the hardware prefetcher falls behind
  const int64_t panel_rows_bytes = kInt4Panel * row_bytes;
  std::atomic<bool> fits{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    bool ok = true;
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = out + p * panel_bytes;
      const int64_t count = std::min<int64_t>(kInt4Panel, rows - p * kInt4Panel);
      if (count < kInt4Panel) std::memset(panel, 0, panel_bytes);
      const uint8_t* first = raw + p * kInt4Panel * row_bytes;
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t n = 0; n < count; ++n) {
          const uint8_t* block = first + n * row_bytes + b * format.block_bytes;
          prefetch(block + panel_rows_bytes, format.block_bytes);
          ok &= Format::pack(block, panel + b * format.panel_block_bytes, n);
        }
    }
    if (!ok) fits = false;
  });
  return fits;
}

}  // namespace

const GgufFormat& gguf_format(const std::string& qtype) {
  for (const GgufFormat& format : kFormats)
    if (qtype == format.name) return format;
  TORCH_CHECK_VALUE(false, "GGUF type ", qtype, " has no panel layout; supported: Q4_0, Q4_1, "
                    "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4");
}

void dequantize_panel_rows(const GgufFormat& format, const at::Tensor& panels,
                           const int64_t* rows, int64_t first, at::Tensor& out) {
  const int64_t count = out.size(0), cols = out.size(1);
  const int64_t blocks = cols / format.block_values;
  const uint8_t* data = panels.data_ptr<uint8_t>();
  const int64_t panel_bytes = panels.size(1) * format.panel_block_bytes;
  const bool to_float = out.scalar_type() == at::kFloat;
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t row_bytes = cols * out.element_size();
  with_format(format.type, [&](auto tag) {
    using Format = decltype(tag);
    // ~64K values a task: a few embedding rows stay on the calling thread
    at::parallel_for(0, count, std::max<int64_t>(1, (int64_t{1} << 16) / cols),
                     [&](int64_t begin, int64_t end) {
      float values[256];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = rows ? rows[i] : first + i;
        const uint8_t* panel = data + (row / kInt4Panel) * panel_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t k0 = b * format.block_values;
          float* target = to_float ? reinterpret_cast<float*>(dst + i * row_bytes) + k0 : values;
          Format::dequantize(panel + b * format.panel_block_bytes, row, target);
          if (!to_float)
            to_bf16_bits(values, reinterpret_cast<uint16_t*>(dst + i * row_bytes) + k0,
                         format.block_values);
        }
      }
    });
  });
}

void check_panels(const GgufFormat& format, const at::Tensor& panels, int64_t cols,
                  const char* op) {
  TORCH_CHECK_VALUE(panels.scalar_type() == at::kByte && panels.dim() == 3 &&
                        panels.is_contiguous() && panels.size(2) == format.panel_block_bytes &&
                        cols > 0 && panels.size(1) * format.block_values == cols,
                    op, ": ", format.name, " panels of K = ", cols, " must be contiguous uint8 "
                    "[ceil(N / 16), ", cols / format.block_values, ", ", format.panel_block_bytes,
                    "] (gguf_pack's), got ", panels.sizes());
}

namespace {

at::Tensor dequantized(const at::Tensor& panels, const std::string& qtype, const int64_t* rows,
                       int64_t first, int64_t count, int64_t cols, at::ScalarType dtype) {
  const GgufFormat& format = gguf_format(qtype);
  check_panels(format, panels, cols, "gguf_dequantize");
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16,
                    "gguf_dequantize: dtype must be float32 or bfloat16");
  const int64_t limit = panels.size(0) * kInt4Panel;
  for (int64_t i = 0; rows && i < count; ++i)
    TORCH_CHECK_INDEX(rows[i] >= 0 && rows[i] < limit, "gguf_dequantize: row ", rows[i],
                      " outside the panels' ", limit, " rows");
  TORCH_CHECK_INDEX(rows || first + count <= limit, "gguf_dequantize: rows ", first, "..",
                    first + count, " outside the panels' ", limit, " rows");
  at::Tensor out = at::empty({count, cols}, panels.options().dtype(dtype));
  if (count > 0) dequantize_panel_rows(format, panels, rows, first, out);
  return out;
}

}  // namespace

at::Tensor gguf_dequantize(const at::Tensor& panels, const std::string& qtype,
                           const at::Tensor& rows, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.scalar_type() == at::kLong,
                    "gguf_dequantize: rows must be int64 [R] (or a range)");
  const at::Tensor indices = rows.contiguous();
  return dequantized(panels, qtype, indices.data_ptr<int64_t>(), 0, indices.numel(), cols, dtype);
}

at::Tensor gguf_dequantize_range(const at::Tensor& panels, const std::string& qtype,
                                 int64_t begin, int64_t end, int64_t cols,
                                 at::ScalarType dtype) {
  TORCH_CHECK_VALUE(0 <= begin && begin <= end, "gguf_dequantize: bad row range ", begin, "..",
                    end);
  return dequantized(panels, qtype, nullptr, begin, end - begin, cols, dtype);
}

at::Tensor gguf_pack(const at::Tensor& raw, const std::string& qtype,
                     const c10::optional<at::Tensor>& out_panels) {
  const GgufFormat& format = gguf_format(qtype);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2,
              "gguf_pack: raw must be uint8 [N, row_bytes] (the tensor's bytes, one row each)");
  const int64_t rows = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK_VALUE(row_bytes > 0 && row_bytes % format.block_bytes == 0, "gguf_pack: ",
                    format.name, " rows of ", row_bytes, " bytes are not whole blocks (",
                    format.block_bytes, " bytes per ", format.block_values, " values)");
  const int64_t blocks = row_bytes / format.block_bytes;
  const at::Tensor src = raw.contiguous();
  const std::vector<int64_t> shape{(rows + kInt4Panel - 1) / kInt4Panel, blocks,
                                   format.panel_block_bytes};
  at::Tensor out = out_panels.has_value() ? *out_panels : at::empty(shape, raw.options());
  // `out`: a run of another tensor's panels (parts of one projection packed in place)
  TORCH_CHECK_VALUE(out.scalar_type() == at::kByte && out.is_contiguous() &&
                        out.sizes() == at::IntArrayRef(shape),
                    "gguf_pack: out must be contiguous uint8 ", at::IntArrayRef(shape),
                    ", got ", out.sizes());
  bool fits = true;
  with_format(format.type, [&](auto tag) {
    fits = pack_panels<decltype(tag)>(src.data_ptr<uint8_t>(), rows, row_bytes, format,
                                      out.data_ptr<uint8_t>(), blocks);
  });
  TORCH_CHECK_VALUE(fits, "gguf_pack: a ", format.name, " block's scale d exceeds 8188, so its "
                    "low -8d does not fit the layout's float16");
  return out;
}

}  // namespace kvserve
