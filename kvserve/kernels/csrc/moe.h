// A mixture-of-experts layer in one C++ call (moe.cpp): routing, each active expert's
// projections over its tokens, the weighted sum; what models/layers/moe.py's Python loop does,
// without its ~40 op calls an expert.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "stack_linear.h"

namespace kvserve {

struct MoeLayer {
  at::Tensor router;  // float32 [E, H]: the router's weights (a row an expert)
  c10::optional<at::Tensor> router_bias;  // float32 [E] (gpt-oss)
  int64_t top_k = 1;
  bool normalize_top_k = false;  // the top k weights renormalised to sum to 1
  // experts' activation over [gate | up]: "silu" (SwiGLU), "gelu_pytorch_tanh" (GeGLU) or
  // "swigluoai" (gpt-oss: gate clamped above at swiglu_limit, up to +-swiglu_limit,
  // (up + 1) * gate * sigmoid(swiglu_alpha * gate))
  std::string activation = "silu";
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  std::vector<StackLinear> gate_up, down;  // expert e's projections
  // a shared expert every token takes, scaled by sigmoid(x . shared_gate) (Qwen2-MoE), or as
  // it is without a gate (DeepSeek)
  c10::optional<StackLinear> shared_gate_up, shared_down;
  c10::optional<at::Tensor> shared_gate;  // float32 [H]
  // DeepSeek's group-limited routing (models/families/deepseek.py's GroupLimitedMoE), in
  // place of softmax top k: router logits in float32; "softmax" scoring (V2: a group rated by
  // its best expert, the other groups' experts scored 0, the top k's probabilities as they are)
  // or "sigmoid" (V3: sigmoid + correction bias choose, a group rated by the sum of its best
  // two, the chosen experts' sigmoid scores, renormalised where normalize_top_k); the top
  // `topk_groups` of `groups` equal groups kept; the weights times routed_scaling
  bool group_limited = false;
  std::string scoring = "softmax";
  int64_t groups = 1, topk_groups = 1;
  c10::optional<at::Tensor> correction_bias;  // float32 [E]
  double routed_scaling = 1.0;
  at::Tensor routed_tokens;  // int64 [E]: += each call's tokens routed to each expert
  // the active experts' projections with span kernels run in one parallel region each (x
  // quantized once); false: each expert's own projection calls (KVSERVE_GROUPED_MOE=0). The
  // same kernels on the same rows, summed in the same order: the same bits either way.
  bool grouped = true;

  // x [T, H] (float32 or bfloat16) -> [T, H] in x's dtype. The router's logits are float dot
  // products rounded to x's dtype (as the Python path's linear in that dtype), softmax in
  // float32, top k (ties: the lower expert), expert outputs weighted and summed in float32 in
  // expert order.
  at::Tensor forward(const at::Tensor& x) const;
  void check() const;
};

// gpt-oss's activation over [T, 2I] rows [gate | up] -> [T, I] (see `activation`), each element
// in float32 and rounded once to h's dtype.
at::Tensor swigluoai_and_mul(const at::Tensor& h, double alpha, double limit);

}  // namespace kvserve
