// kvserve CPU kernels: the per-layer glue of a decoder step fused into single passes, and paged
// attention that reads K/V blocks where they lie in the cache.
//
// Why: in eager PyTorch one decoder layer is ~55 small ops (~5 us each) and decode attention
// gathered every sequence's blocks into fresh tensors each layer. Here a layer is 4 GEMMs plus
// 5 calls. Numerics follow the torch reference ops (kvserve/kernels/reference.py): float
// accumulation, and rounding to the activation dtype at the same points as HF transformers, so
// float32 runs give the reference's greedy tokens.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "decode_stack.h"
#include "layer_ops.h"
#include "flash_attention.h"
#include "latent_attention.h"
#include "lora.h"
#include "bf16_gemm.h"
#include "gguf_amx.h"
#include "gguf_gemm.h"
#include "int4_gemm.h"
#include "int8_gemm.h"
#include "q8_dot_gemm.h"
#include "sampling.h"
#include "vec.h"

namespace {

using namespace kvserve;  // vf, vload, vfma, ... (vec.h): one source for AVX2 and AVX-512
using kvserve::exp_shifted_sum;
using kvserve::max_of;

using at::BFloat16;

inline float to_float(float v) { return v; }
inline float to_float(BFloat16 v) { return static_cast<float>(v); }

template <typename T> inline T from_float(float v) { return static_cast<T>(v); }

// Round a float through the storage dtype (a no-op for float).
template <typename T> inline float round_trip(float v) { return to_float(from_float<T>(v)); }

inline void store_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// float -> bf16 with round-to-nearest-even, as c10::BFloat16's conversion.
inline void store_row(const float* src, BFloat16* dst, int64_t n) {
  kvserve::to_bf16_bits(src, reinterpret_cast<uint16_t*>(dst), n);
}

// Round every value through the storage dtype (a no-op for float).
inline void round_row(float*, int64_t, float*) {}
inline void round_row(float* values, int64_t n, BFloat16* scratch) {
  store_row(values, scratch, n);
  load_row(scratch, values, n);
}

template <typename T> struct RoundScratch {
  std::vector<T> buffer;
  explicit RoundScratch(int64_t n) : buffer(std::is_same<T, float>::value ? 0 : n) {}
  void operator()(float* values, int64_t n) {
    if constexpr (!std::is_same<T, float>::value) round_row(values, n, buffer.data());
  }
};

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if KVSERVE_VEC
  const vf a = vset1(alpha);
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vfma(a, vload(x + i), vload(y + i)));
#endif
  for (; i < n; ++i) y[i] += alpha * x[i];
}


// values[i] = silu(values[i]) = v / (1 + exp(-v))
inline void silu_row(float* values, int64_t n) {
  int64_t i = 0;
#if KVSERVE_VEC
  const vf one = vset1(1.f);
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = vload(values + i);
    vstore(values + i, vdiv(v, vadd(one, vexp(vsub(vzero(), v)))));
  }
#endif
  for (; i < n; ++i) values[i] = values[i] / (1.f + std::exp(-values[i]));
}

// ---------------------------------------------------------------- RMSNorm (+ residual add)

// Per-thread float rows for one op's row loop.
template <typename T> struct RowScratch {
  std::vector<float> a, b;
  RoundScratch<T> round;
  explicit RowScratch(int64_t n) : a(n), b(n), round(n) {}
};

// out = weight * dtype(x * rsqrt(mean(x^2) + eps)), as HF's LlamaRMSNorm; x is in scratch.a.
// weight_offset != 0 (Gemma): out = dtype(x * rsqrt(...) * (weight_offset + weight)), all in
// float, as HF's GemmaRMSNorm.
template <typename T>
void rms_norm_row(const T* weight, T* out, int64_t hidden, float eps, float weight_offset,
                  RowScratch<T>& scratch) {
  float* x = scratch.a.data();
  float inv = 1.f / std::sqrt(dot(x, x, hidden) / hidden + eps);
  for (int64_t i = 0; i < hidden; ++i) x[i] *= inv;
  float* w = scratch.b.data();
  load_row(weight, w, hidden);
  if (weight_offset == 0.f) {
    scratch.round(x, hidden);
  } else {
    for (int64_t i = 0; i < hidden; ++i) w[i] = weight_offset + w[i];
  }
  for (int64_t i = 0; i < hidden; ++i) x[i] *= w[i];
  store_row(x, out, hidden);
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps,
                   double weight_offset, const at::Tensor* residual) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    RowScratch<T> scratch(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* x_row = x.data_ptr<T>() + r * x.stride(0);
      load_row(x_row, scratch.a.data(), hidden);
      if (residual) {
        // residual <- residual + x (rounded to dtype, as the eager add), x <- norm(residual)
        T* res_row = residual->data_ptr<T>() + r * residual->stride(0);
        load_row(res_row, scratch.b.data(), hidden);
        for (int64_t i = 0; i < hidden; ++i) scratch.a[i] += scratch.b[i];
        store_row(scratch.a.data(), res_row, hidden);
        scratch.round(scratch.a.data(), hidden);
      }
      rms_norm_row<T>(w, out.data_ptr<T>() + r * out.stride(0), hidden,
                      static_cast<float>(eps), static_cast<float>(weight_offset), scratch);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    double weight_offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with unit stride");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be in x's dtype");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
      AT_DISPATCH_CASE(at::kFloat,
                       [&] { rms_norm_impl<float>(x, weight, out, eps, weight_offset, nullptr); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rms_norm_impl<BFloat16>(x, weight, out, eps, weight_offset, nullptr);
      }));
  return out;
}

// residual += x; x = rms_norm(residual) (both in place, one pass).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                   double weight_offset) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "add_rms_norm_: contiguous only");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "add_rms_norm_: weight in x's dtype");
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm_",
      AT_DISPATCH_CASE(at::kFloat,
                       [&] { rms_norm_impl<float>(x, weight, x, eps, weight_offset, &residual); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rms_norm_impl<BFloat16>(x, weight, x, eps, weight_offset, &residual);
      }));
}

// QK-norm (Qwen3, Gemma 3): each query and key head of the fused QKV rows normalised in place
// over its head_dim values, with the query or the key norm's weight, before RoPE.
template <typename T>
void rms_norm_heads_impl(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float eps,
                         float weight_offset) {
  const int64_t heads = num_heads + num_kv_heads, tokens = qkv.size(0);
  at::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    RowScratch<T> scratch(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t token = i / heads, head = i % heads;
      T* values = qkv.data_ptr<T>() + token * qkv.stride(0) + head * head_dim;
      load_row(values, scratch.a.data(), head_dim);
      const T* weight = (head < num_heads ? q_weight : k_weight).data_ptr<T>();
      rms_norm_row<T>(weight, values, head_dim, eps, weight_offset, scratch);
    }
  });
}

void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                     double weight_offset) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) >= (num_heads + num_kv_heads) * head_dim,
              "rms_norm_heads_: qkv must be [T, (H + 2 KVH) * D] rows");
  TORCH_CHECK(q_weight.numel() == head_dim && k_weight.numel() == head_dim &&
                  q_weight.scalar_type() == qkv.scalar_type() &&
                  k_weight.scalar_type() == qkv.scalar_type(),
              "rms_norm_heads_: weights of head_dim in qkv's dtype");
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rms_norm_heads_",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rms_norm_heads_impl<float>(qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim,
                                   static_cast<float>(eps), static_cast<float>(weight_offset));
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rms_norm_heads_impl<BFloat16>(qkv, q_weight, k_weight, num_heads, num_kv_heads,
                                      head_dim, static_cast<float>(eps),
                                      static_cast<float>(weight_offset));
      }));
}

// GeGLU (Gemma): tanh-GELU(gate) * up through ATen's own ops, so it equals the torch reference
// (kernels/reference.py) to the bit; here so the decode stack can run it without Python.
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return at::gelu(halves[0], "tanh") * halves[1];
}

// ---------------------------------------------------------------- SiLU(gate) * up

template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    RowScratch<T> scratch(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up.data_ptr<T>() + r * gate_up.stride(0);
      float* act = scratch.a.data();
      load_row(gate, act, inter);
      silu_row(act, inter);
      scratch.round(act, inter);  // torch rounds silu's output before the multiply
      load_row(gate + inter, scratch.b.data(), inter);
      for (int64_t i = 0; i < inter; ++i) act[i] *= scratch.b[i];
      store_row(act, out.data_ptr<T>() + r * inter, inter);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1, "silu_and_mul: [T, 2I] rows");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_and_mul",
      AT_DISPATCH_CASE(at::kFloat, [&] { silu_and_mul_impl<float>(gate_up, out); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { silu_and_mul_impl<BFloat16>(gate_up, out); }));
  return out;
}

// ---------------------------------------------------------------- RoPE + KV cache write

// Rotate-half RoPE on one head in place: x*cos + rotate_half(x)*sin, each product and the sum
// rounded to dtype as the eager reference does.
template <typename T>
inline void rotate_head(T* head, const float* cos_sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    float c = round_trip<T>(cos_sin[i]), s = round_trip<T>(cos_sin[half + i]);
    float first = to_float(head[i]), second = to_float(head[half + i]);
    float new_first = round_trip<T>(first * c) + round_trip<T>(-second * s);
    float new_second = round_trip<T>(second * c) + round_trip<T>(first * s);
    head[i] = from_float<T>(new_first);
    head[half + i] = from_float<T>(new_second);
  }
}

// K/V rows into a cache slot of element type C: a copy, or float rounded to bf16 (a bf16 cache
// beside float activations).
inline void copy_to_cache(const float* src, float* dst, int64_t n) { store_row(src, dst, n); }
inline void copy_to_cache(const float* src, BFloat16* dst, int64_t n) { store_row(src, dst, n); }
inline void copy_to_cache(const BFloat16* src, BFloat16* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(BFloat16));
}

// The largest |value| of one head's row (float or bf16 activations).
template <typename T>
inline float row_absmax(const T* src, int64_t n) {
  float absmax = 0.f;
  int64_t i = 0;
#if KVSERVE_VEC
  vf peak = vzero();
  for (; i + kLanes <= n; i += kLanes) peak = vmax(peak, vabs(vload(src + i)));
  absmax = vmaxall(peak);
#endif
  for (; i < n; ++i) absmax = std::max(absmax, std::fabs(to_float(src[i])));
  return absmax;
}

// One head's row into an int8 cache row: scale = absmax / 127, codes = round(x / scale) to
// nearest even (an all-zero row: scale 0, codes 0), the scale stored after the n codes. The same
// float operations as reference.quantize_kv_rows, so both write the same bytes.
template <typename T>
inline void copy_to_cache(const T* src, int8_t* dst, int64_t n) {
  const float scale = row_absmax(src, n) / 127.f;
  const float divisor = scale > 0.f ? scale : 1.f;
  int64_t i = 0;
#if KVSERVE_VEC
  const vf d = vset1(divisor), low = vset1(-127.f), high = vset1(127.f);
  for (; i + kLanes <= n; i += kLanes) {
    vstore_codes(dst + i, vmin(vmax(vround(vdiv(vload(src + i), d)), low), high));
  }
#endif
  for (; i < n; ++i) {
    const float code = std::nearbyint(to_float(src[i]) / divisor);
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  std::memcpy(dst + n, &scale, sizeof(float));
}

// One head's row into an fp8 cache row: scale = absmax / 448 (e4m3's largest value), codes =
// x / scale clamped to +-448 and rounded to the nearest e4m3 value, ties to even (c10's
// conversion, which torch's .to(torch.float8_e4m3fn) uses: reference.quantize_kv_rows writes the
// same bytes); an all-zero row: scale 0, codes 0. Scalar: a row is written once per token, read
// by every later step.
template <typename T>
inline void copy_to_cache(const T* src, c10::Float8_e4m3fn* dst, int64_t n) {
  constexpr float kMax = 448.f;
  const float scale = row_absmax(src, n) / kMax;
  const float divisor = scale > 0.f ? scale : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = c10::Float8_e4m3fn(std::min(kMax, std::max(-kMax, to_float(src[i]) / divisor)));
  }
  std::memcpy(dst + n, &scale, sizeof(float));
}

// The cache's elements as C: an fp8 cache is a uint8 tensor of e4m3 bytes (reference.py says
// why), which data_ptr<c10::Float8_e4m3fn>() would refuse.
template <typename C>
C* cache_data(const at::Tensor& kv_cache) {
  if constexpr (std::is_same<C, c10::Float8_e4m3fn>::value) {
    return reinterpret_cast<C*>(kv_cache.data_ptr<uint8_t>());
  } else {
    return kv_cache.data_ptr<C>();
  }
}

template <typename T, typename C>
void rope_and_cache_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                         at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim) {
  const int64_t tokens = qkv.size(0);
  const int64_t block_size = kv_cache.size(2);
  const int64_t kv_width = num_kv_heads * head_dim;
  const int64_t cache_row = cache_row_width<C>(head_dim);
  const int64_t slot_stride = num_kv_heads * cache_row;
  const int64_t cache_half = kv_cache.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  C* cache = cache_data<C>(kv_cache);
  TORCH_CHECK(kv_cache.size(4) == cache_row && kv_cache.stride(1) == block_size * slot_stride,
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, row]");
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv.data_ptr<T>() + t * qkv.stride(0);
      const float* cs = table + pos[t] * cos_sin.stride(0);
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rotate_head<T>(row + h * head_dim, cs, head_dim);
      T* key = row + num_heads * head_dim;
      T* value = key + kv_width;
      C* slot = cache + slots[t] * slot_stride;
      if constexpr (kRowExtra<C> == 0) {
        copy_to_cache(key, slot, kv_width);
        copy_to_cache(value, slot + cache_half, kv_width);
      } else {  // one scale per head's row
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          copy_to_cache(key + h * head_dim, slot + h * cache_row, head_dim);
          copy_to_cache(value + h * head_dim, slot + cache_half + h * cache_row, head_dim);
        }
      }
    }
  });
}

// The cache holds qkv's dtype, or bf16 beside float32 activations (half the KV bytes), or
// quantized rows with their scales beside either: int8 (kChar) or fp8 e4m3 (stored as kByte).
void check_cache_dtype(const at::Tensor& qkv, const at::Tensor& kv_cache, const char* op) {
  const auto q = qkv.scalar_type(), c = kv_cache.scalar_type();
  TORCH_CHECK((q == at::kFloat || q == at::kBFloat16) &&
                  (c == q || c == at::kChar || c == at::kByte ||
                   (q == at::kFloat && c == at::kBFloat16)),
              op, ": the KV cache must be in qkv's dtype (float32 or bfloat16), bfloat16 "
              "with float32 qkv, int8 rows, or fp8 e4m3 rows (a uint8 tensor); it is ", c);
}

// Runs fn with (T, C) the element types of qkv and the cache (after check_cache_dtype).
template <typename Fn>
void dispatch_cache_types(const at::Tensor& qkv, const at::Tensor& kv_cache, Fn&& fn) {
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  switch (kv_cache.scalar_type()) {
    case at::kChar:
      if (bf16) fn(BFloat16{}, int8_t{});
      else fn(float{}, int8_t{});
      break;
    case at::kByte:  // fp8 e4m3 rows
      if (bf16) fn(BFloat16{}, c10::Float8_e4m3fn{});
      else fn(float{}, c10::Float8_e4m3fn{});
      break;
    case at::kBFloat16:
      if (bf16) fn(BFloat16{}, BFloat16{});
      else fn(float{}, BFloat16{});
      break;
    default: fn(float{}, float{});
  }
}

// qkv [T, (H + 2 KVH) * D]: rotates Q and K in place and writes K, V to their cache slots.
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_and_cache_: qkv must be [T, N]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "rope_and_cache_: positions and slot_mapping must be int64");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              "rope_and_cache_: cos_sin must be a contiguous float32 table");
  check_cache_dtype(qkv, kv_cache, "rope_and_cache_");
  dispatch_cache_types(qkv, kv_cache, [&](auto t, auto c) {
    rope_and_cache_impl<decltype(t), decltype(c)>(qkv, positions, cos_sin, kv_cache,
                                                  slot_mapping, num_heads, num_kv_heads,
                                                  head_dim);
  });
}

// ---------------------------------------------------------------- paged attention

struct PagedArgs {
  const int32_t* seq_ids;     // which sequences of the batch to process
  const int64_t* query_start; // [num_seqs + 1]
  const int32_t* seq_lens;    // [num_seqs]
  const int32_t* tables;      // [num_seqs, max_blocks]
  int64_t table_stride, block_size, num_heads, num_kv_heads, head_dim;
  float scale;
  int64_t window;  // > 0: a query at p sees keys k with p - k < window; else every k <= p
  float softcap;   // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2), else as they are
  // [num_heads] or null: each query head's learned sink logit (gpt-oss), one more term of its
  // softmax's denominator that weighs no value
  const float* sinks;
};

#if KVSERVE_VEC
// Scores of R query rows (kept in registers) against every key row; DIM / kLanes vectors per row,
// each key chunk loaded once and used by all R rows.
template <typename T, int DIM, int R, typename ForEachRow>
void score_block(ForEachRow& for_each_row, const float* queries, float scale, float* scores,
                 int64_t stride) {
  constexpr int C = DIM / kLanes;
  vf q[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) q[r][c] = vload(queries + r * DIM + c * kLanes);
  for_each_row(0, [&](const T* row, int64_t pos, int64_t) {
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    for (int c = 0; c < C; ++c) {
      const vf k = vload(row + c * kLanes);
      for (int r = 0; r < R; ++r) acc[r] = vfma(q[r][c], k, acc[r]);
    }
    const float row_factor = scale * row_scale(row, DIM);  // 1 x scale for float/bf16 rows
    for (int r = 0; r < R; ++r) scores[r * stride + pos] = vsum(acc[r]) * row_factor;
  });
}

// acc rows += sum over keys of probability * value row, for R rows held in registers.
template <typename T, int DIM, int R, typename ForEachRow>
void weigh_block(ForEachRow& for_each_row, const float* probs, float* acc, int64_t stride) {
  constexpr int C = DIM / kLanes;
  vf sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = vzero();
  for_each_row(1, [&](const T* row, int64_t pos, int64_t) {
    vf p[R];
    const float factor = row_scale(row, DIM);
    for (int r = 0; r < R; ++r) p[r] = vset1(probs[r * stride + pos] * factor);
    for (int c = 0; c < C; ++c) {
      const vf v = vload(row + c * kLanes);
      for (int r = 0; r < R; ++r) sum[r][c] = vfma(p[r], v, sum[r][c]);
    }
  });
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(acc + r * DIM + c * kLanes, sum[r][c]);
}

// Rows in chunks of up to R_MAX: the queries (or sums) of R_MAX rows fill about half the vector
// registers (AVX-512 head dim 64: 4 rows; AVX2 or head dim 128: fewer).
template <typename T, int DIM, bool SCORES, typename ForEachRow>
void blocked_rows(ForEachRow& for_each_row, const float* src, int64_t rows, float scale,
                  float* dst, int64_t stride) {
  constexpr int R_MAX = std::max(1, std::min(4, kVecRegisters / 2 / (DIM / kLanes)));
  for (int64_t r0 = 0; r0 < rows; r0 += R_MAX) {
    const int64_t n = std::min<int64_t>(R_MAX, rows - r0);
    auto run = [&](auto r_const) {
      constexpr int R = decltype(r_const)::value;
      if constexpr (SCORES) {
        score_block<T, DIM, R>(for_each_row, src + r0 * DIM, scale, dst + r0 * stride, stride);
      } else {
        weigh_block<T, DIM, R>(for_each_row, src + r0 * stride, dst + r0 * DIM, stride);
      }
    };
    if (n == 1) run(std::integral_constant<int, 1>{});
    else if constexpr (R_MAX >= 2) {
      if (n == 2) run(std::integral_constant<int, 2>{});
      else if constexpr (R_MAX >= 4) {
        if (n == 3) run(std::integral_constant<int, 3>{});
        else run(std::integral_constant<int, 4>{});
      }
    }
  }
}
#endif

#if KVSERVE_VEC == 8
// The 4 lane sums of a[0..3] as one 128-bit vector: one hadd tree instead of 4 reductions.
inline __m128 sum4(const __m256* a) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// AVX2 QK pass: 4 keys at a time against each query row. With 16 registers the AVX-512 way (query
// rows held in registers, one key at a time) keeps one row and one dependent FMA chain per key,
// latency-bound (a batch-32 decode layer at context 512 took 1.45 ms); here 4 keys give 4
// independent chains, the query chunks come from L1, and one hadd tree sums the 4 dot products.
template <typename T, int DIM, typename ForEachRow>
void score_rows_tiled(ForEachRow& for_each_row, const float* queries, int64_t rows, float scale,
                      float* scores, int64_t stride) {
  const T* keys[4];
  int64_t positions[4];
  int count = 0;
  auto flush = [&]() {
    for (int j = count; j < 4; ++j) keys[j] = keys[0];  // padding lanes, never stored
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = queries + r * DIM;
      __m256 acc[4] = {vzero(), vzero(), vzero(), vzero()};
      for (int c = 0; c < DIM; c += kLanes) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 4; ++j) acc[j] = vfma(qc, vload(keys[j] + c), acc[j]);
      }
      float sums[4];
      _mm_storeu_ps(sums, _mm_mul_ps(sum4(acc), _mm_set1_ps(scale)));
      for (int j = 0; j < count; ++j) {
        scores[r * stride + positions[j]] = sums[j] * row_scale(keys[j], DIM);
      }
    }
    count = 0;
  };
  for_each_row(0, [&](const T* row, int64_t pos, int64_t) {
    keys[count] = row;
    positions[count] = pos;
    if (++count == 4) flush();
  });
  if (count) flush();
}

// AVX2 QK and PV passes for tasks of several tokens (verifications, short chunks), over a list
// of the task's K (or V) row pointers in key order. Why: through for_each_row's callback each key
// and value row was loaded (and widened from bf16) once per query row, and GCC kept
// score_rows_tiled's key pointers and weigh_block's sums in memory, each key's last FMA waiting
// on a store-to-load round trip (perf: half of the PV pass's samples on one FMA); a 9-token
// verification (27 rows a KV head, SmolLM2) spent 17% of its AVX2 step here. These are plain
// loops over registers that load each key chunk once for 2 rows (QK) and each value chunk once
// for 4 (PV). Each score and sum is computed as those two compute it (the same FMA chain over
// the same chunks, the same hadd tree, keys in order), so the bits are theirs.

// The 4 dot products of each of R query rows with keys k[0..3] (4 chains a row; R = 2: 8 chains,
// each key chunk loaded once for both rows), each row's 4 sums as one 128-bit vector.
template <int DIM, int R, typename C>
inline void dot4(const float* q, const C* const* k, __m128* sums) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = vzero();
  for (int c = 0; c < DIM; c += kLanes) {
    const __m256 keys[4] = {vload(k[0] + c), vload(k[1] + c), vload(k[2] + c), vload(k[3] + c)};
    for (int r = 0; r < R; ++r) {
      const __m256 qc = _mm256_loadu_ps(q + r * DIM + c);
      for (int j = 0; j < 4; ++j) acc[r][j] = vfma(qc, keys[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = sum4(acc[r]);
}

// scores[r][j] for 4 keys at once (the last ones padded with copies of a real key), rows in
// pairs; `count` of the 4 stored.
template <int DIM, typename C>
void score_four(const C* const* k, int count, const float* queries, int64_t rows, float scale,
                float* scores, int64_t stride) {
  const __m128 scales = _mm_set1_ps(scale);
  auto store = [&](int64_t r, __m128 sums) {
    sums = _mm_mul_ps(sums, scales);
    if (count == 4) return _mm_storeu_ps(scores + r * stride, sums);
    float lanes[4];
    _mm_storeu_ps(lanes, sums);
    for (int j = 0; j < count; ++j) scores[r * stride + j] = lanes[j];
  };
  __m128 sums[2];
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    dot4<DIM, 2, C>(queries + r * DIM, k, sums);
    store(r, sums[0]);
    store(r + 1, sums[1]);
  }
  if (r < rows) {
    dot4<DIM, 1, C>(queries + r * DIM, k, sums);
    store(r, sums[0]);
  }
}

template <int DIM, typename C>
void score_listed(const C* const* keys, int64_t span, const float* queries, int64_t rows,
                  float scale, float* scores, int64_t stride) {
  for (int64_t j = 0; j < span; j += 4) {  // 4 keys (1 KB at DIM 64) stay in L1 for every row
    const C* k[4];
    for (int i = 0; i < 4; ++i) k[i] = keys[std::min(j + i, span - 1)];
    score_four<DIM, C>(k, static_cast<int>(std::min<int64_t>(4, span - j)), queries, rows, scale,
                       scores + j, stride);
  }
}

// acc[r] = sum over keys of probs[r][key] * value row, for R rows and 16 output dims at once:
// 8 registers of sums, each value chunk loaded once for the R rows. Each output's chain over the
// keys is the same whichever rows and dims share the block.
template <int DIM, int R, typename C>
void weigh_listed_rows(const C* const* values, int64_t span, const float* probs, float* acc,
                       int64_t stride) {
  for (int d0 = 0; d0 < DIM; d0 += 2 * kLanes) {
    __m256 sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = vzero();
    for (int64_t key = 0; key < span; ++key) {
      const C* v = values[key] + d0;
      const __m256 low = vload(v), high = vload(v + kLanes);
      for (int r = 0; r < R; ++r) {
        const __m256 weight = vset1(probs[r * stride + key]);
        sum[r][0] = vfma(weight, low, sum[r][0]);
        sum[r][1] = vfma(weight, high, sum[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      vstore(acc + r * DIM + d0, sum[r][0]);
      vstore(acc + r * DIM + d0 + kLanes, sum[r][1]);
    }
  }
}

template <int DIM, typename C>
void weigh_listed(const C* const* values, int64_t span, const float* probs, int64_t rows,
                  float* acc, int64_t stride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    weigh_listed_rows<DIM, 4, C>(values, span, probs + r * stride, acc + r * DIM, stride);
  const float* p = probs + r * stride;
  float* out = acc + r * DIM;
  switch (rows - r) {
    case 3: weigh_listed_rows<DIM, 3, C>(values, span, p, out, stride); break;
    case 2: weigh_listed_rows<DIM, 2, C>(values, span, p, out, stride); break;
    case 1: weigh_listed_rows<DIM, 1, C>(values, span, p, out, stride); break;
    default: break;
  }
}
#endif

// Register-blocked QK pass for head_dim 64 or 128 on vector builds; false: caller runs the
// generic one. `listed` (AVX2, several tokens: lists_rows): the key rows' pointers, in order.
template <typename T, typename ForEachRow>
bool score_rows_fast(ForEachRow& for_each_row, const T* const* listed, int64_t span,
                     const float* queries, int64_t rows, int64_t dim, float scale, float* scores,
                     int64_t stride) {
#if KVSERVE_VEC == 8
  if (listed && dim == 64) {
    return score_listed<64, T>(listed, span, queries, rows, scale, scores, stride), true;
  }
  if (listed && dim == 128) {
    return score_listed<128, T>(listed, span, queries, rows, scale, scores, stride), true;
  }
  if (dim == 64) return score_rows_tiled<T, 64>(for_each_row, queries, rows, scale, scores, stride), true;
  if (dim == 128) return score_rows_tiled<T, 128>(for_each_row, queries, rows, scale, scores, stride), true;
#elif KVSERVE_VEC
  if (dim == 64) return blocked_rows<T, 64, true>(for_each_row, queries, rows, scale, scores, stride), true;
  if (dim == 128) return blocked_rows<T, 128, true>(for_each_row, queries, rows, scale, scores, stride), true;
#endif
  return false;
}

template <typename T, typename ForEachRow>
bool weigh_values_fast(ForEachRow& for_each_row, const T* const* listed, int64_t span,
                       const float* probs, int64_t rows, int64_t dim, float* acc, int64_t stride) {
#if KVSERVE_VEC == 8
  if (listed && dim == 64) return weigh_listed<64, T>(listed, span, probs, rows, acc, stride), true;
  if (listed && dim == 128) {
    return weigh_listed<128, T>(listed, span, probs, rows, acc, stride), true;
  }
#endif
#if KVSERVE_VEC
  if (dim == 64) return blocked_rows<T, 64, false>(for_each_row, probs, rows, 0.f, acc, stride), true;
  if (dim == 128) return blocked_rows<T, 128, false>(for_each_row, probs, rows, 0.f, acc, stride), true;
#endif
  return false;
}

// Whether attend_seq_head takes the listed passes: an AVX2 build, float or bf16 rows (quantized
// rows, int8 or fp8, scale each dot product after it), a head size they take, and more rows than
// one token's query heads (a decode's few rows reuse each key row from L1 anyway).
template <typename C>
bool lists_rows(int64_t rows, int64_t group, int64_t dim) {
  if constexpr (kQuantizedRows<C> || KVSERVE_VEC != 8) return false;
  return (dim == 64 || dim == 128) && rows > group;
}

// One (sequence, KV head): its n new query tokens x G grouped query heads against every cached
// key they may see (causal, within the window if any), reading K and V rows in place, block by
// block. Two passes (scores, then the weighted sum of V) so each K and V row is read once per
// pass; all in float32. Keys before the first query's window, and their blocks' table entries,
// are never read: scores are indexed from key0, the first key any query here sees.
// Rows [row_begin, row_end) of the task's n * G (token j, query head g: row j * G + g); each
// row's arithmetic is the same whichever rows share the call, so a task split into parts gives
// the same bits as the whole task.
template <typename T, typename C>
void attend_seq_head(const PagedArgs& a, const T* qkv, int64_t qkv_stride, const C* cache,
                     int64_t cache_half, T* out, int64_t out_stride, int64_t seq, int64_t kvh,
                     int64_t row_begin, int64_t row_end, std::vector<float>& buf) {
  const int64_t group = a.num_heads / a.num_kv_heads, dim = a.head_dim;
  const int64_t q_begin = a.query_start[seq], n = a.query_start[seq + 1] - q_begin;
  const int64_t seq_len = a.seq_lens[seq], rows = row_end - row_begin;
  const int64_t first_pos = seq_len - n;
  const int64_t key0 = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  const int64_t span = seq_len - key0;  // keys key0..seq_len-1: score columns 0..span-1
  buf.resize(rows * dim * 2 + rows * span + dim);
  float* queries = buf.data();
  float* acc = queries + rows * dim;
  float* scores = acc + rows * dim;
  float* kv_row = scores + rows * span;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* q = qkv + (q_begin + r / group) * qkv_stride + (kvh * group + r % group) * dim;
    load_row(q, queries + (r - row_begin) * dim, dim);
  }
  const int32_t* table = a.tables + seq * a.table_stride;
  const int64_t cache_row = cache_row_width<C>(dim);
  const int64_t slot_stride = a.num_kv_heads * cache_row;
  const int64_t num_blocks = (seq_len + a.block_size - 1) / a.block_size;
  // Visit every key row from key0 once: fn(row pointer, its score column pos - key0, first
  // query row of the task that sees it).
  auto for_each_row = [&](int64_t half, auto&& fn) {
    for (int64_t b = key0 / a.block_size; b < num_blocks; ++b) {
      const int64_t first = std::max(b * a.block_size, key0);
      const int64_t last = std::min(seq_len, (b + 1) * a.block_size);
      const C* row = cache + half * cache_half +
                     (table[b] * a.block_size + first - b * a.block_size) * slot_stride +
                     kvh * cache_row;
      for (int64_t pos = first; pos < last; ++pos, row += slot_stride) {
        // query j (absolute position first_pos + j) sees keys up to first_pos + j
        fn(row, pos - key0, (pos > first_pos ? pos - first_pos : 0) * group);
      }
    }
  };
  // the listed passes' K and V row pointers, in key order
  std::vector<const C*> listed(lists_rows<C>(rows, group, dim) ? 2 * span : 0);
  for (int64_t half = 0; half < 2 && !listed.empty(); ++half) {
    for_each_row(half, [&](const C* row, int64_t col, int64_t) {
      listed[half * span + col] = row;
    });
  }
  const C* const* keys = listed.empty() ? nullptr : listed.data();
  if (!score_rows_fast<C>(for_each_row, keys, span, queries, rows, dim, a.scale, scores, span)) {
    for_each_row(0, [&](const C* row, int64_t col, int64_t r0) {
      load_row(row, kv_row, dim);
      for (int64_t r = std::max<int64_t>(r0 - row_begin, 0); r < rows; ++r) {
        scores[r * span + col] = dot(queries + r * dim, kv_row, dim) * a.scale;
      }
    });
  }
  // Row r (of this call) sees score columns [lo, hi): causal, and inside its own window.
  auto visible = [&](int64_t r) {
    const int64_t hi = first_pos + (row_begin + r) / group + 1 - key0;
    return std::pair<int64_t, int64_t>(a.window > 0 ? std::max<int64_t>(0, hi - a.window) : 0, hi);
  };
  if (a.softcap > 0.f) {  // after the scale, before the softmax, as HF's eager path
    for (int64_t r = 0; r < rows; ++r) {
      const auto [lo, hi] = visible(r);
      float* s = scores + r * span;
      for (int64_t c = lo; c < hi; ++c) s[c] = std::tanh(s[c] / a.softcap) * a.softcap;
    }
  }
  std::vector<float> inv_sum(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const auto [lo, hi] = visible(r);
    float* s = scores + r * span + lo;
    float shift = max_of(s, hi - lo), sink_term = 0.f;
    if (a.sinks) {  // HF's eager path: the sink joins the max and the sum
      const float sink = a.sinks[kvh * group + (row_begin + r) % group];
      shift = std::max(shift, sink);
      sink_term = std::exp(sink - shift);
    }
    inv_sum[r] = 1.f / (exp_shifted_sum(s, hi - lo, shift) + sink_term);
  }
  // Keys a query may not see weigh zero (the register-blocked pass visits them all).
  for (int64_t r = 0; r < rows; ++r) {
    const auto [lo, hi] = visible(r);
    std::fill(scores + r * span, scores + r * span + lo, 0.f);
    std::fill(scores + r * span + hi, scores + (r + 1) * span, 0.f);
  }
  const C* const* values = listed.empty() ? nullptr : listed.data() + span;
  if (!weigh_values_fast<C>(for_each_row, values, span, scores, rows, dim, acc, span)) {
    std::memset(acc, 0, rows * dim * sizeof(float));
    for_each_row(1, [&](const C* row, int64_t col, int64_t r0) {
      load_row(row, kv_row, dim);
      for (int64_t r = std::max<int64_t>(r0 - row_begin, 0); r < rows; ++r) {
        axpy(scores[r * span + col], kv_row, acc + r * dim, dim);
      }
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* result = acc + r * dim;
    for (int64_t d = 0; d < dim; ++d) result[d] *= inv_sum[r];
    const int64_t row = row_begin + r;
    store_row(result,
              out + (q_begin + row / group) * out_stride + (kvh * group + row % group) * dim, dim);
  }
}

// Parts to split each (sequence, KV head) task's query rows into: with fewer tasks than twice
// the threads, whole tasks leave threads idle (batch 1, SmolLM2: 3 KV heads on 2 threads ran
// 2:1 rows; in 2 parts, 5:4). Each part reads its task's K/V rows again, from cache.
int64_t row_parts(int64_t tasks, int64_t max_rows) {
  const int64_t wanted = 2 * at::get_num_threads();
  if (tasks >= wanted) return 1;
  return std::max<int64_t>(1, std::min(max_rows, (wanted + tasks - 1) / tasks));
}

template <typename T, typename C>
void paged_attention_impl(const at::Tensor& qkv, const at::Tensor& kv_cache, at::Tensor& out,
                          const PagedArgs& a, int64_t num_tasks_seqs) {
  const int64_t seq_tasks = num_tasks_seqs * a.num_kv_heads;
  const T* qkv_ptr = qkv.data_ptr<T>();
  const C* cache = cache_data<C>(kv_cache);
  T* out_ptr = out.data_ptr<T>();
  // bf16 on AVX512-BF16: the dot-product-instruction version (decode_attention.cpp)
  bool bf16_fast = false;
  if constexpr (std::is_same<T, BFloat16>::value && std::is_same<C, BFloat16>::value) {
    bf16_fast = kvserve::decode_attention_supported(a.head_dim) && a.softcap == 0.f &&
                a.sinks == nullptr;
  }
  const int64_t group = a.num_heads / a.num_kv_heads;
  int64_t max_rows = 0;
  for (int64_t i = 0; i < num_tasks_seqs; ++i) {
    const int64_t seq = a.seq_ids[i];
    max_rows = std::max(max_rows, (a.query_start[seq + 1] - a.query_start[seq]) * group);
  }
  // the bf16 dot-product kernel takes whole tasks
  const int64_t parts = bf16_fast ? 1 : row_parts(seq_tasks, max_rows);
  at::parallel_for(0, seq_tasks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    kvserve::DecodeScratch scratch;
    for (int64_t part_task = begin; part_task < end; ++part_task) {
      const int64_t task = part_task / parts, part = part_task % parts;
      int64_t seq = a.seq_ids[task / a.num_kv_heads];
      if constexpr (std::is_same<T, BFloat16>::value && std::is_same<C, BFloat16>::value) {
        if (bf16_fast) {
          const int64_t q_begin = a.query_start[seq];
          const kvserve::DecodeTask t{
              qkv_ptr, qkv.stride(0), q_begin, cache, kv_cache.stride(0),
              a.tables + seq * a.table_stride, a.block_size, a.num_kv_heads,
              task % a.num_kv_heads, a.num_heads / a.num_kv_heads, a.head_dim,
              a.query_start[seq + 1] - q_begin, a.seq_lens[seq], a.window, a.scale, out_ptr,
              out.stride(0)};
          kvserve::decode_attention_task(t, scratch);
          continue;
        }
      }
      const int64_t rows = (a.query_start[seq + 1] - a.query_start[seq]) * group;
      const int64_t row_begin = rows * part / parts, row_end = rows * (part + 1) / parts;
      if (row_begin == row_end) continue;
      attend_seq_head<T, C>(a, qkv_ptr, qkv.stride(0), cache, kv_cache.stride(0), out_ptr,
                            out.stride(0), seq, task % a.num_kv_heads, row_begin, row_end, buf);
    }
  });
}

// Attention for the sequences in seq_ids, whose K/V (this step's included) are already in the
// cache. qkv [T, (H + 2 KVH) * D] holds the rotated queries; out [T, H * D] gets their rows.
// sliding_window > 0: a query at position p sees keys k with p - k < sliding_window only.
// softcap > 0 (Gemma 2): each scaled score becomes softcap * tanh(score / softcap).
// sinks (gpt-oss): float32 [num_heads], each head's learned logit added to its softmax.
void paged_attention_(const at::Tensor& qkv, const at::Tensor& kv_cache, at::Tensor& out,
                      const at::Tensor& seq_ids, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                      int64_t sliding_window, double softcap,
                      const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->numel() == num_heads),
              "paged_attention_: sinks must be contiguous float32 [num_heads]");
  TORCH_CHECK(seq_ids.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kLong,
              "paged_attention_: int32 ids/lens/tables and int64 query_start_loc expected");
  TORCH_CHECK(block_tables.is_contiguous() && out.stride(1) == 1 && qkv.stride(1) == 1,
              "paged_attention_: bad layout");
  PagedArgs args{seq_ids.data_ptr<int32_t>(), query_start_loc.data_ptr<int64_t>(),
                 seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
                 block_tables.size(1), kv_cache.size(2), num_heads, num_kv_heads, head_dim,
                 static_cast<float>(scale), sliding_window, static_cast<float>(softcap),
                 sinks ? sinks->data_ptr<float>() : nullptr};
  check_cache_dtype(qkv, kv_cache, "paged_attention_");
  TORCH_CHECK(out.scalar_type() == qkv.scalar_type(),
              "paged_attention_: out must be in qkv's dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "paged_attention_: kv_cache "
              "must be contiguous [2, blocks, block_size, kv_heads, row]");
  dispatch_cache_types(qkv, kv_cache, [&](auto t, auto c) {
    using C = decltype(c);
    TORCH_CHECK(kv_cache.size(4) == cache_row_width<C>(head_dim),
                "paged_attention_: the cache's rows do not match head_dim");
    paged_attention_impl<decltype(t), C>(qkv, kv_cache, out, args, seq_ids.numel());
  });
}

// ---------------------------------------------------------------- W8A8 helpers

// Dynamic per-token int8: scale = absmax / 127 (1 for an all-zero row), codes = round(x / scale).
template <typename T>
void quantize_per_token_impl(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales) {
  const int64_t rows = x.size(0), cols = x.size(1);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(cols);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x.data_ptr<T>() + r * x.stride(0), row.data(), cols);
      float absmax = 0.f;
      int64_t i = 0;
#if KVSERVE_VEC
      vf peak = vzero();
      for (; i + kLanes <= cols; i += kLanes) peak = vmax(peak, vabs(vload(&row[i])));
      absmax = vmaxall(peak);
#endif
      for (; i < cols; ++i) absmax = std::max(absmax, std::fabs(row[i]));
      float scale = absmax > 0.f ? absmax / 127.f : 1.f;
      scales.data_ptr<float>()[r] = scale;
      int8_t* dst = codes.data_ptr<int8_t>() + r * cols;
      i = 0;
#if defined(__AVX512F__)
      // x / scale (a true division, as the reference), round half to even, saturate to int8
      const __m512 divisor = _mm512_set1_ps(scale);
      for (; i + 16 <= cols; i += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(&row[i]), divisor),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
      }
#elif KVSERVE_VEC == 8
      const __m256 divisor = _mm256_set1_ps(scale);
      for (; i + 8 <= cols; i += 8) {
        __m256 q = vround(_mm256_div_ps(_mm256_loadu_ps(&row[i]), divisor));
        q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
        const __m256i ints = _mm256_cvtps_epi32(q);
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints),
                                              _mm256_extracti128_si256(ints, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(words, words));
      }
#endif
      for (; i < cols; ++i) {
        float q = std::nearbyint(row[i] / scale);
        dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_per_token: x must be [M, K] rows");
  auto codes = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  AT_DISPATCH_SWITCH(x.scalar_type(), "quantize_per_token",
      AT_DISPATCH_CASE(at::kFloat, [&] { quantize_per_token_impl<float>(x, codes, scales); })
      AT_DISPATCH_CASE(at::kBFloat16,
                       [&] { quantize_per_token_impl<BFloat16>(x, codes, scales); }));
  return {codes, scales};
}

template <typename T>
void dequantize_int32_impl(const at::Tensor& acc, const float* token_scale,
                           const float* weight_scale, const T* bias, at::Tensor& out) {
  const int64_t rows = acc.size(0), cols = acc.size(1);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(cols), bias_row(bias ? cols : 0);
    if (bias) load_row(bias, bias_row.data(), cols);
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* src = acc.data_ptr<int32_t>() + r * acc.stride(0);
      const float scale = token_scale[r];
      int64_t c = 0;
#if defined(__AVX512F__)
      // (acc * token scale) * weight scale, the reference's order, 16 columns at a time
      const __m512 s = _mm512_set1_ps(scale);
      for (; c + 16 <= cols; c += 16) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(src + c)), s);
        v = _mm512_mul_ps(v, _mm512_loadu_ps(weight_scale + c));
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_row.data() + c));
        _mm512_storeu_ps(row.data() + c, v);
      }
#elif KVSERVE_VEC == 8
      const __m256 s = _mm256_set1_ps(scale);
      for (; c + 8 <= cols; c += 8) {
        const __m256i ints = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(ints), s);
        v = _mm256_mul_ps(v, _mm256_loadu_ps(weight_scale + c));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias_row.data() + c));
        _mm256_storeu_ps(row.data() + c, v);
      }
#endif
      for (; c < cols; ++c) {
        row[c] = static_cast<float>(src[c]) * scale * weight_scale[c];
        if (bias) row[c] += bias_row[c];
      }
      store_row(row.data(), out.data_ptr<T>() + r * cols, cols);
    }
  });
}

// out[m, n] = acc[m, n] * token_scale[m] * weight_scale[n] (+ bias[n]), in dtype.
at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& token_scale,
                            const at::Tensor& weight_scale, const c10::optional<at::Tensor>& bias,
                            at::ScalarType dtype) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.stride(1) == 1, "dequantize_int32: int32 rows");
  TORCH_CHECK(token_scale.scalar_type() == at::kFloat && weight_scale.scalar_type() == at::kFloat,
              "dequantize_int32: float32 scales");
  auto out = at::empty(acc.sizes(), acc.options().dtype(dtype));
  AT_DISPATCH_SWITCH(dtype, "dequantize_int32",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        dequantize_int32_impl<float>(acc, token_scale.data_ptr<float>(),
                                     weight_scale.data_ptr<float>(),
                                     bias ? bias->data_ptr<float>() : nullptr, out);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        dequantize_int32_impl<BFloat16>(acc, token_scale.data_ptr<float>(),
                                        weight_scale.data_ptr<float>(),
                                        bias ? bias->data_ptr<BFloat16>() : nullptr, out);
      }));
  return out;
}

// ---------------------------------------------------------------- greedy sampling

inline int64_t argmax_row(const float* row, int64_t cols) {
  bool has_nan;
  const float best = max_of_checked(row, cols, has_nan);
  for (int64_t j = 0; j < cols; ++j) {
    if (has_nan ? std::isnan(row[j]) : row[j] == best) return j;
  }
  return 0;
}

// Index of each row's maximum (the first one on ties; a NaN wins, as in torch.argmax). torch's
// CPU argmax took ~1-2 ms for 32 x 49k logits here; this is one vectorised pass plus a scan.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: float32 [B, V] rows expected");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits.data_ptr<float>() + r * logits.stride(0);
      out.data_ptr<int64_t>()[r] = argmax_row(row, cols);
    }
  });
  return out;
}

}  // namespace

namespace kvserve::layer_ops {  // the ops above, for C++ callers (layer_ops.h)

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    double weight_offset) {
  return ::rms_norm(x, weight, eps, weight_offset);
}
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                   double weight_offset) {
  ::add_rms_norm_(x, residual, weight, eps, weight_offset);
}
void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                     double weight_offset) {
  ::rms_norm_heads_(qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps,
                    weight_offset);
}
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return ::silu_and_mul(gate_up); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) { return ::gelu_tanh_and_mul(gate_up); }
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim) {
  ::rope_and_cache_(qkv, positions, cos_sin, kv_cache, slot_mapping, num_heads, num_kv_heads,
                    head_dim);
}
void paged_attention_(const at::Tensor& qkv, const at::Tensor& kv_cache, at::Tensor& out,
                      const at::Tensor& seq_ids, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                      int64_t sliding_window, double softcap,
                      const c10::optional<at::Tensor>& sinks) {
  ::paged_attention_(qkv, kv_cache, out, seq_ids, query_start_loc, seq_lens, block_tables,
                     num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap, sinks);
}

}  // namespace kvserve::layer_ops

// The GIL is released inside every kernel (they touch no Python objects), so the server's event
// loop can stream tokens while a step runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] rows", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("weight_offset") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("weight_offset") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_heads_", &rms_norm_heads_,
        "QK-norm: each query and key head of fused QKV rows RMS-normalised in place",
        py::arg("qkv"), py::arg("q_weight"), py::arg("k_weight"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
        py::arg("weight_offset") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of [T, 2I] rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "tanh-GELU(gate) * up of [T, 2I] rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("swigluoai_and_mul", &kvserve::swigluoai_and_mul,
        "gpt-oss's clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)",
        py::arg("gate_up"), py::arg("alpha"), py::arg("limit"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_and_cache_", &rope_and_cache_, "RoPE on Q/K in place + write K/V to the cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_", &paged_attention_, "causal attention over paged K/V, in place",
        py::arg("qkv"), py::arg("kv_cache"), py::arg("out"), py::arg("seq_ids"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("latent_attention_", &kvserve::latent_attention_,
        "latent attention (MLA) over the paged latent rows, absorbed: each head's weighted "
        "sum of latents into out [T, H, R]",
        py::arg("out"), py::arg("q_latent"), py::arg("q_rope"), py::arg("rows"),
        py::arg("seq_ids"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("block_tables"), py::arg("block_size"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("flash_attention_", &kvserve::flash_attention_,
        "tiled causal attention over paged bf16 K/V (sequences with many new tokens), in place",
        py::arg("qkv"), py::arg("kv_cache"), py::arg("out"), py::arg("seq_ids"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("flash_attention_supported", &kvserve::flash_attention_supported,
        "whether flash_attention_ runs for this head_dim on this build");
  m.def("quantize_per_token", &quantize_per_token, "dynamic per-token int8 codes and scales",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "per-row argmax of float32 logits",
        py::call_guard<py::gil_scoped_release>());
  m.def("top_p_mask_", &kvserve::top_p_mask_,
        "-inf outside each row's top-p nucleus, in place, without sorting the vocabulary",
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask_", &kvserve::apply_token_bitmask_,
        "-inf wherever a row's token bitmask bit is clear, in place (structured output)",
        py::call_guard<py::gil_scoped_release>());
  m.def("draw_rows", &kvserve::draw_rows, "one inverse-CDF draw per row from the softmax of its logits",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_int32", &dequantize_int32, "int32 GEMM output * scales (+ bias) -> dtype",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear", &kvserve::int4_linear,
        "x @ W.T (+ bias) with groupwise int4 W in the panel layout (few-row GEMMs)",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_linear", &kvserve::bf16_linear,
        "x @ W.T (+ bias) with bf16 W in the panel layout (few-row GEMMs)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &kvserve::int8_linear,
        "x @ W.T (+ bias) with groupwise int8 W (GGUF Q8_0) in the panel layout (few rows)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear_q8", &kvserve::int4_linear_q8,
        "x' @ W.T (+ bias): x rounded to int8 per group of 32, int4 W, integer dot products",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear_q8", &kvserve::int8_linear_q8,
        "x' @ W.T (+ bias): x rounded to int8 per group of 32, Q8_0 W, integer dot products",
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_pack", &kvserve::gguf_pack,
        "a GGUF tensor's bytes [N, row_bytes] -> panels of its own codes and scales (into "
        "`out`, contiguous panels of that shape, if given)",
        py::arg("raw"), py::arg("qtype"), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  // rows: int64 indices or a range (step 1), read while the GIL is held
  m.def("gguf_dequantize",
        [](const at::Tensor& panels, const std::string& qtype, const py::object& rows,
           int64_t in_features, at::ScalarType dtype) {
          if (PyRange_Check(rows.ptr())) {
            const auto start = rows.attr("start").cast<int64_t>();
            const auto stop = rows.attr("stop").cast<int64_t>();
            TORCH_CHECK_VALUE(rows.attr("step").cast<int64_t>() == 1,
                              "gguf_dequantize: a row range must have step 1");
            py::gil_scoped_release release;
            return kvserve::gguf_dequantize_range(panels, qtype, start, std::max(start, stop),
                                                  in_features, dtype);
          }
          const auto indices = rows.cast<at::Tensor>();
          py::gil_scoped_release release;
          return kvserve::gguf_dequantize(panels, qtype, indices, in_features, dtype);
        },
        "rows of gguf_pack's panels -> the file's values [R, K] (float32 bit-exact) in dtype",
        py::arg("panels"), py::arg("qtype"), py::arg("rows"), py::arg("in_features"),
        py::arg("dtype"));
  m.def("gguf_linear_q8", &kvserve::gguf_linear_q8,
        "x' @ W.T (+ bias): x rounded to int8 per group of 32, GGUF W as the file stores it",
        py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("bias"),
        py::arg("out_features"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_linear_q8k", &kvserve::gguf_linear_q8k,
        "x' @ W.T (+ bias): x rounded to int8 per super-block of 256 (Q8_K), K-quant W as stored",
        py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("bias"),
        py::arg("out_features"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_linear_int", &kvserve::gguf_linear_int,
        "the engine's integer path: gguf_linear_q8k for K-quant calls of 8+ rows, else q8",
        py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("bias"),
        py::arg("out_features"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_superblocks_enabled", &kvserve::gguf_superblocks_enabled,
        "whether gguf_linear_int takes super-block activations (KVSERVE_GGUF_SUPERBLOCKS=0: off)");
  m.def("set_gguf_superblocks", &kvserve::set_gguf_superblocks,
        "switch gguf_linear_int's super-block activations on or off", py::arg("enabled"));
  m.def("gguf_linear_dequant", &kvserve::gguf_linear_dequant,
        "x @ W.T (+ bias) with GGUF W's exact values, dequantized a slab of rows at a time",
        py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("bias"),
        py::arg("out_features"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_linear_amx", &kvserve::gguf_linear_amx,
        "x @ W.T (+ bias), x bfloat16, GGUF K-quant W dequantized into bfloat16 AMX tiles",
        py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("bias"),
        py::arg("out_features"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_amx_usable", &kvserve::gguf_amx_usable,
        "whether gguf_linear_dequant runs bfloat16 x on AMX tiles here (KVSERVE_AMX=0: off)");
  m.def("set_gguf_amx", &kvserve::set_gguf_amx,
        "switch the AMX tiles of gguf_linear_dequant on or off (where the CPU has them)",
        py::arg("enabled"));
  m.def("lora_add_", &kvserve::lora_add_,
        "out[t] += (x[t] @ a[s].T) @ b[s] for each row t of slot s = slots[t] >= 0 (grouped LoRA)",
        py::arg("x"), py::arg("out"), py::arg("a"), py::arg("b"), py::arg("slots"),
        py::arg("gemm_rows") = kvserve::kNoGemm, py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear_fast", &kvserve::int4_linear_fast,
        "whether int4_linear is vectorised on this build");
  m.def("q8_dot_wide", &kvserve::q8_dot_wide,
        "whether int4_linear_q8 takes a whole 16-output panel per instruction (AVX512-VNNI)");
  // module_local: each ISA level is its own module in one process (the tests load several)
  py::class_<kvserve::StackLinear>(m, "StackLinear", py::module_local())
      .def(py::init([](std::string kind, at::Tensor panels, at::Tensor dense,
                       c10::optional<at::Tensor> bias, int64_t out_features, int64_t max_rows,
                       std::string qtype, std::vector<kvserve::StackLinear> segments) {
             return kvserve::StackLinear{std::move(kind), std::move(panels), std::move(dense),
                                         std::move(bias), out_features, max_rows,
                                         std::move(qtype), std::move(segments)};
           }),
           "one projection: kind (int4, int4_q8, bf16, dense, gguf, concat), panels, dense copy, "
           "bias, N, the kernel's row limit, a gguf block type, a concat's segments",
           py::arg("kind"), py::arg("panels"), py::arg("dense"), py::arg("bias"),
           py::arg("out_features"), py::arg("max_rows"), py::arg("qtype") = "",
           py::arg("segments") = std::vector<kvserve::StackLinear>());
  py::class_<kvserve::MoeLayer, std::shared_ptr<kvserve::MoeLayer>>(m, "MoeLayer",
                                                                    py::module_local())
      .def(py::init([](at::Tensor router, int64_t top_k, bool normalize_top_k,
                       std::string activation, std::vector<kvserve::StackLinear> gate_up,
                       std::vector<kvserve::StackLinear> down, at::Tensor routed_tokens,
                       c10::optional<kvserve::StackLinear> shared_gate_up,
                       c10::optional<kvserve::StackLinear> shared_down,
                       c10::optional<at::Tensor> shared_gate,
                       c10::optional<at::Tensor> router_bias, double swiglu_alpha,
                       double swiglu_limit, bool grouped) {
             auto layer = std::make_shared<kvserve::MoeLayer>();
             layer->grouped = grouped;
             layer->router = std::move(router);
             layer->router_bias = std::move(router_bias);
             layer->top_k = top_k, layer->normalize_top_k = normalize_top_k;
             layer->activation = std::move(activation);
             layer->swiglu_alpha = swiglu_alpha, layer->swiglu_limit = swiglu_limit;
             layer->gate_up = std::move(gate_up), layer->down = std::move(down);
             layer->routed_tokens = std::move(routed_tokens);
             layer->shared_gate_up = std::move(shared_gate_up);
             layer->shared_down = std::move(shared_down);
             layer->shared_gate = std::move(shared_gate);
             layer->check();
             return layer;
           }),
           "a mixture-of-experts layer: float32 router [E, H], top k, each expert's gate_up and "
           "down StackLinear, the int64 [E] routed-token counters it adds to, a shared expert; "
           "grouped: every active expert's projections in one parallel region each",
           py::arg("router"), py::arg("top_k"), py::arg("normalize_top_k"),
           py::arg("activation"), py::arg("gate_up"), py::arg("down"), py::arg("routed_tokens"),
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(), py::arg("router_bias") = py::none(),
           py::arg("swiglu_alpha") = 1.702, py::arg("swiglu_limit") = 7.0,
           py::arg("grouped") = true)
      .def("set_group_limited_routing",
           [](kvserve::MoeLayer& layer, std::string scoring, int64_t groups, int64_t topk_groups,
              c10::optional<at::Tensor> correction_bias, double routed_scaling) {
             layer.group_limited = true;
             layer.scoring = std::move(scoring);
             layer.groups = groups, layer.topk_groups = topk_groups;
             layer.correction_bias = std::move(correction_bias);
             layer.routed_scaling = routed_scaling;
             layer.check();
           },
           "DeepSeek's routing in place of softmax top k (moe.h: group_limited)",
           py::arg("scoring"), py::arg("groups"), py::arg("topk_groups"),
           py::arg("correction_bias"), py::arg("routed_scaling"))
      .def("forward", &kvserve::MoeLayer::forward,
           "routing, the active experts over their tokens, the weighted sum: [T, H] -> [T, H]",
           py::call_guard<py::gil_scoped_release>());
  py::class_<kvserve::StackInstruction>(m, "StackInstruction", py::module_local())
      .def(py::init([](int64_t op, int64_t dst, int64_t src, int64_t aux,
                       c10::optional<at::Tensor> weight, c10::optional<at::Tensor> key_weight,
                       double eps, double weight_offset,
                       c10::optional<kvserve::StackLinear> linear,
                       c10::optional<at::Tensor> kv_cache, c10::optional<at::Tensor> cos_sin,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t sliding_window, double scale, double softcap, double limit,
                       std::shared_ptr<kvserve::MoeLayer> moe, c10::optional<at::Tensor> sinks,
                       c10::optional<at::Tensor> lora_a, c10::optional<at::Tensor> lora_b,
                       int64_t lora_gemm_rows) {
             TORCH_CHECK(op >= 0 && op <= static_cast<int64_t>(kvserve::StackOp::kMoe),
                         "decode stack: unknown op ", op);
             kvserve::StackInstruction in;
             in.op = static_cast<kvserve::StackOp>(op);
             in.dst = dst, in.src = src, in.aux = aux;
             if (weight) in.weight = *weight;
             if (key_weight) in.key_weight = *key_weight;
             in.eps = eps, in.weight_offset = weight_offset;
             if (linear) in.linear = *linear;
             if (kv_cache) in.kv_cache = *kv_cache;
             if (cos_sin) in.cos_sin = *cos_sin;
             in.num_heads = num_heads, in.num_kv_heads = num_kv_heads, in.head_dim = head_dim;
             in.sliding_window = sliding_window, in.scale = scale, in.softcap = softcap;
             in.limit = limit, in.moe = std::move(moe);
             if (sinks) in.sinks = *sinks;
             TORCH_CHECK(lora_a.has_value() == lora_b.has_value(),
                         "decode stack: a LoRA needs both a and b");
             if (lora_a) in.lora_a = *lora_a, in.lora_b = *lora_b;
             in.lora_gemm_rows = lora_gemm_rows;
             return in;
           }),
           "one op of a recorded layer program (models/decode_stack.py)", py::arg("op"),
           py::arg("dst") = -1, py::arg("src") = -1, py::arg("aux") = -1,
           py::arg("weight") = py::none(), py::arg("key_weight") = py::none(),
           py::arg("eps") = 0.0, py::arg("weight_offset") = 0.0,
           py::arg("linear") = py::none(), py::arg("kv_cache") = py::none(),
           py::arg("cos_sin") = py::none(), py::arg("num_heads") = 0,
           py::arg("num_kv_heads") = 0, py::arg("head_dim") = 0,
           py::arg("sliding_window") = 0, py::arg("scale") = 1.0, py::arg("softcap") = 0.0,
           py::arg("limit") = 0.0, py::arg("moe") = py::none(), py::arg("sinks") = py::none(),
           py::arg("lora_a") = py::none(), py::arg("lora_b") = py::none(),
           py::arg("lora_gemm_rows") = kvserve::kNoGemm);
  py::class_<kvserve::DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<kvserve::StackInstruction>, int64_t, int64_t>(),
           py::arg("program"), py::arg("num_registers"), py::arg("output"))
      .def("run", &kvserve::DecodeStack::run,
           "the stage's decoder layers for a step whose sequences take the paged or flash kernel",
           py::arg("residual"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("seq_ids"), py::arg("flash_seq_ids"), py::arg("query_start_loc"),
           py::arg("seq_lens"), py::arg("block_tables"), py::arg("lora_slots") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
