// Latent attention (DeepSeek's MLA) over the paged latent cache, in the absorbed form: each
// head's query already in latent space (q_nope W_UK, done by the caller as one batched matmul),
// so a step reads only the cached rows, one a token (the latent, then the RoPE key), and every
// head of a sequence scores against the same rows. One task per (sequence, group of heads): each
// cached row is turned into floats once per task and scored by every head of the group (pass
// one), then, after each head's softmax, read again and added into each head's weighted sum of
// latents (pass two); the caller applies W_UV to the sums. Float math throughout; the rows may be
// float32, bf16, or int8 / fp8 codes each part followed by its float32 scale (vec.h's rows).
// Written against vec.h, so the AVX2 and AVX-512 builds come from this one source.

#include "latent_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace kvserve {
namespace {

// acc[i] += weight * x[i]
inline void add_scaled(float* acc, const float* x, float weight, int64_t n) {
  int64_t i = 0;
#if KVSERVE_VEC
  const vf w = vset1(weight);
  for (; i + kLanes <= n; i += kLanes) vstore(acc + i, vfma(vload(x + i), w, vload(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += weight * x[i];
}

struct LatentArgs {
  const float* q_latent;
  const float* q_rope;
  float* out;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t table_stride, block_size, heads, rank, rope, row_stride;
  float scale;
};

// One sequence's query tokens, heads [h0, h1).
template <typename C>
void attend(const LatentArgs& a, const C* cache, int64_t seq, int64_t h0, int64_t h1,
            std::vector<float>& row, std::vector<float>& scores) {
  const int64_t q_begin = a.query_start[seq], q_end = a.query_start[seq + 1];
  const int64_t length = a.seq_lens[seq], heads = h1 - h0, rank = a.rank, rope = a.rope;
  const int32_t* table = a.tables + seq * a.table_stride;
  const int64_t rope_offset = cache_row_width<C>(rank);  // the RoPE key's part of a row
  scores.resize(heads * length);
  for (int64_t t = q_begin; t < q_end; ++t) {
    const int64_t count = length - (q_end - t) + 1;  // positions 0 .. the token's own
    const float* q_lat = a.q_latent + (t * a.heads + h0) * rank;
    const float* q_rope = a.q_rope + (t * a.heads + h0) * rope;
    for (int64_t p = 0; p < count; ++p) {
      const C* cached = cache + (static_cast<int64_t>(table[p / a.block_size]) * a.block_size +
                                 p % a.block_size) * a.row_stride;
      load_row(cached, row.data(), rank);
      load_row(cached + rope_offset, row.data() + rank, rope);
      for (int64_t h = 0; h < heads; ++h) {
        scores[h * count + p] = a.scale * (dot(row.data(), q_lat + h * rank, rank) +
                                           dot(row.data() + rank, q_rope + h * rope, rope));
      }
    }
    float* out = a.out + (t * a.heads + h0) * rank;
    std::fill(out, out + heads * rank, 0.f);
    for (int64_t h = 0; h < heads; ++h) {
      float* head_scores = scores.data() + h * count;
      const float total = exp_shifted_sum(head_scores, count, max_of(head_scores, count));
      const float inverse = 1.f / total;
      for (int64_t p = 0; p < count; ++p) head_scores[p] *= inverse;
    }
    for (int64_t p = 0; p < count; ++p) {
      const C* cached = cache + (static_cast<int64_t>(table[p / a.block_size]) * a.block_size +
                                 p % a.block_size) * a.row_stride;
      load_row(cached, row.data(), rank);
      for (int64_t h = 0; h < heads; ++h) {
        add_scaled(out + h * rank, row.data(), scores[h * count + p], rank);
      }
    }
  }
}

template <typename C>
void run(const LatentArgs& a, const C* cache, const int32_t* seq_ids, int64_t num_seqs) {
  // enough tasks for every thread when few sequences decode (a single stream: its heads split)
  const int64_t threads = at::get_num_threads();
  const int64_t groups = std::min<int64_t>(a.heads, std::max<int64_t>(
      1, (threads + num_seqs - 1) / std::max<int64_t>(num_seqs, 1)));
  at::parallel_for(0, num_seqs * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(a.rank + a.rope), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = seq_ids[task / groups], group = task % groups;
      const int64_t h0 = a.heads * group / groups, h1 = a.heads * (group + 1) / groups;
      if (h0 < h1 && a.query_start[seq + 1] > a.query_start[seq]) {
        attend<C>(a, cache, seq, h0, h1, row, scores);
      }
    }
  });
}

}  // namespace

void latent_attention_(at::Tensor& out, const at::Tensor& q_latent, const at::Tensor& q_rope,
                       const at::Tensor& rows, const at::Tensor& seq_ids,
                       const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, const at::Tensor& block_tables,
                       int64_t block_size, double scale) {
  TORCH_CHECK(q_latent.scalar_type() == at::kFloat && q_rope.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "latent_attention_: queries and out must be float32");
  TORCH_CHECK(q_latent.is_contiguous() && q_rope.is_contiguous() && out.is_contiguous() &&
                  q_latent.dim() == 3 && q_rope.dim() == 3 && out.sizes() == q_latent.sizes(),
              "latent_attention_: contiguous [T, H, R] queries and out, [T, H, P] RoPE queries");
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1, "latent_attention_: rows [slots, row]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_ids.scalar_type() == at::kInt && seq_ids.is_contiguous(),
              "latent_attention_: int32 seq_ids, query_start_loc, seq_lens and block tables");
  const int64_t num_seqs = seq_ids.size(0);
  const int32_t* ids = seq_ids.data_ptr<int32_t>();
  LatentArgs a{q_latent.data_ptr<float>(), q_rope.data_ptr<float>(), out.data_ptr<float>(),
               query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
               block_tables.data_ptr<int32_t>(), block_tables.size(1), block_size,
               q_latent.size(1), q_latent.size(2), q_rope.size(2), rows.stride(0),
               static_cast<float>(scale)};
  switch (rows.scalar_type()) {
    case at::kFloat: run<float>(a, rows.data_ptr<float>(), ids, num_seqs); break;
    case at::kBFloat16: run<c10::BFloat16>(a, rows.data_ptr<c10::BFloat16>(), ids, num_seqs); break;
    case at::kChar: run<int8_t>(a, rows.data_ptr<int8_t>(), ids, num_seqs); break;
    case at::kByte:  // fp8 e4m3 rows, held as their bytes
      run<c10::Float8_e4m3fn>(
          a, reinterpret_cast<const c10::Float8_e4m3fn*>(rows.data_ptr<uint8_t>()), ids,
          num_seqs);
      break;
    default:
      TORCH_CHECK(false, "latent_attention_: rows must be float32, bfloat16, int8 or fp8 (uint8), "
                         "not ", rows.scalar_type());
  }
}

}  // namespace kvserve
