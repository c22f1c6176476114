// Grouped LoRA for a step's rows (the segmented / punica "SGMV" approach): every adapter of the
// step in one call per projection, instead of a gather, two matmuls and a scatter per adapter.
#pragma once

#include <ATen/ATen.h>

namespace kvserve {

// out[t] += (x[t] @ a[s].T) @ b[s] for each row t whose slot s = slots[t] is >= 0 (-1: the base
// model's rows, left alone). x [T, K] and out [T, N] float32 or bf16 (the same dtype); a
// [S, W, K] and b [S, W, N] (B stored transposed, so the expand streams whole output rows) in
// float32 or bf16; slots int32 [T]. The low-rank products are float32 throughout; out is
// rounded once.
void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slots);

}  // namespace kvserve
