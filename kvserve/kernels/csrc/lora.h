// Grouped LoRA for a step's rows (the segmented / punica "SGMV" approach): every adapter of the
// step in one call per projection, instead of a gather, two matmuls and a scatter per adapter.
#pragma once

#include <ATen/ATen.h>

namespace kvserve {

// out[t] += (x[t] @ a[s].T) @ b[s] for each row t whose slot s = slots[t] is >= 0 (-1: the base
// model's rows, left alone). x [T, K] and out [T, N] float32 or bf16 (the same dtype); a
// [S, W, K] and b [S, W, N] (B stored transposed, so the expand streams whole output rows) in
// float32 or bf16; slots int32 [T]. The low-rank products are float32 throughout; out is
// rounded once. A run of more than gemm_rows consecutive rows of one slot (a prompt's chunk)
// takes two dense GEMMs instead (at::mm and addmm_, oneDNN: in x's dtype, so bf16 rounds the
// [rows, W] product once, as PEFT's bf16 layers do); the autotuner measures gemm_rows per
// shape (models/lora/slots.py), kNoGemm never.
constexpr int64_t kNoGemm = int64_t{1} << 62;
void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slots, int64_t gemm_rows = kNoGemm);

}  // namespace kvserve
