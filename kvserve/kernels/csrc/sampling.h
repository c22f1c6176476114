// Random sampling's per-row passes over the vocabulary (sampling.cpp), for kvserve/sample/.
#pragma once

#include <ATen/ATen.h>

namespace kvserve {

// -inf, in place, outside each row's top-p nucleus: the shortest run of its best logits (ties:
// lowest token ids first) whose float64 softmax mass reaches top_p[r], by the sort's rule (a
// token stays while the mass strictly before it is under top_p; the best always stays).
// float32 [R, V] rows, float64 top_p; a row with a NaN, no finite logit or top_p >= 1 is left
// as it is. kvserve/sample/top_p.py::top_p_mask_ is the torch reference.
void top_p_mask_(at::Tensor& logits, const at::Tensor& top_p);

// One draw per row from the softmax of float32 logits [R, V]: the first token whose running
// float64 sum of its masses e^(logit - best) (each in float32) exceeds uniforms[r] (float64 in
// [0, 1)) times the row's total.
// A token of logit -inf is never drawn; a row without a finite logit, or with a NaN, draws 0.
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& uniforms);

// Structured output's mask, in place: logits row rows[i] gets -inf at every token whose bit in
// bitmask row mask_rows[i] is clear (xgrammar's layout: int32 words, bit j of word w is token
// 32 w + j). A row whose mask allows none of its tokens is left as it is.
// kvserve/kernels/reference.py::apply_token_bitmask_ is the torch reference.
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                          const at::Tensor& mask_rows);

}  // namespace kvserve
