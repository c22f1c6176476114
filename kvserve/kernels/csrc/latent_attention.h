// Latent attention (DeepSeek's MLA) over the paged latent cache, absorbed form
// (latent_attention.cpp; kvserve/attention/latent.py is the caller and reference.py's
// latent_attention_ the torch version).
#pragma once

#include <ATen/ATen.h>

namespace kvserve {

// out [T, H, R] float32 <- for each query token t (of the sequences in seq_ids) and head
// h, the softmax over the sequence's cached positions p <= t's position of
// scale * (q_latent[t, h] . latent_p + q_rope[t, h] . rope_p), weighting the latents latent_p.
// q_latent [T, H, R], q_rope [T, H, P]: float32 (queries in latent space, the RoPE part
// rotated); rows [slots, row]: the layer's cache as one row a token (the latent, then the RoPE
// key; float32, bf16, or int8 / fp8 e4m3 (uint8) codes each part followed by its float32 scale);
// block_tables [S, max_blocks] int32, seq_lens [S] and query_start_loc [S + 1]: int32, on the CPU;
// seq_ids int32: the sequences to attend (other tokens' rows of out are left as they are).
void latent_attention_(at::Tensor& out, const at::Tensor& q_latent, const at::Tensor& q_rope,
                       const at::Tensor& rows, const at::Tensor& seq_ids,
                       const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, const at::Tensor& block_tables,
                       int64_t block_size, double scale);

}  // namespace kvserve
