// The fused mixture of experts (moe.h). Why in C++: the Python loop (models/layers/moe.py's
// `run`) made ~40 op calls an active expert (gathers, index_add_, dtype casts) and a bf16
// router GEMV through oneDNN at ~0.2 ms; at batch 1 on OLMoE-1B-7B (16 layers, top 8) that was
// ~60 ms of a ~105 ms step (torch.profiler, Emerald Rapids). Here routing is a few float dot
// products, tokens are grouped by expert, each active expert runs the projection kernels the
// Python path would call (StackLinear: the same stored formats and row limits) over its own
// tokens only, so at batch 1 only the chosen experts' weights are read.
#include "moe.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "layer_ops.h"
#include "vec.h"

namespace kvserve {
namespace {

// A float computed in float32 as the Python path's linear in x's dtype would return it.
float as_dtype(float v, at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? static_cast<float>(c10::BFloat16(v)) : v;
}

// Each token's top k experts and their weights, [T, k] each.
struct Routes {
  std::vector<int64_t> expert;
  std::vector<float> weight;
};

template <typename T>
void route_rows(const MoeLayer& moe, const at::Tensor& x, int64_t begin, int64_t end,
                Routes& routes) {
  const int64_t experts = moe.router.size(0), hidden = x.size(1), k = moe.top_k;
  const float* router = moe.router.data_ptr<float>();
  std::vector<float> probabilities(experts);
  std::vector<int64_t> order(experts);
  for (int64_t t = begin; t < end; ++t) {
    const T* row = x.data_ptr<T>() + t * x.stride(0);
    float peak = -INFINITY;
    const float* bias = moe.router_bias ? moe.router_bias->data_ptr<float>() : nullptr;
    for (int64_t e = 0; e < experts; ++e) {
      const float logit = dot(row, router + e * hidden, hidden) + (bias ? bias[e] : 0.f);
      probabilities[e] = as_dtype(logit, x.scalar_type());
      peak = std::max(peak, probabilities[e]);
    }
    float sum = 0.f;
    for (float& p : probabilities) sum += (p = std::exp(p - peak));
    for (float& p : probabilities) p /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return probabilities[a] > probabilities[b] || (probabilities[a] == probabilities[b] && a < b);
    });
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) chosen += probabilities[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      routes.expert[t * k + j] = order[j];
      const float p = probabilities[order[j]];
      routes.weight[t * k + j] = moe.normalize_top_k ? p / chosen : p;
    }
  }
}

Routes route(const MoeLayer& moe, const at::Tensor& x) {
  const int64_t tokens = x.size(0);
  Routes routes{std::vector<int64_t>(tokens * moe.top_k), std::vector<float>(tokens * moe.top_k)};
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kFloat) {
      route_rows<float>(moe, x, begin, end, routes);
    } else {
      route_rows<c10::BFloat16>(moe, x, begin, end, routes);
    }
  });
  return routes;
}

// gpt-oss's activation over [T, 2I] rows [gate | up] -> [T, I], in float32 per element.
template <typename T>
void swigluoai_rows(const at::Tensor& h, at::Tensor& out, float alpha, float limit) {
  const int64_t width = out.size(1);
  for (int64_t t = 0; t < h.size(0); ++t) {
    const T* gate = h.data_ptr<T>() + t * h.stride(0);
    const T* up = gate + width;
    T* dst = out.data_ptr<T>() + t * out.stride(0);
    for (int64_t i = 0; i < width; ++i) {
      const float g = std::min(static_cast<float>(gate[i]), limit);
      const float u = std::clamp(static_cast<float>(up[i]), -limit, limit);
      dst[i] = static_cast<T>((u + 1.f) * (g / (1.f + std::exp(-alpha * g))));
    }
  }
}

at::Tensor expert_mlp(const MoeLayer& moe, const StackLinear& gate_up, const StackLinear& down,
                      const at::Tensor& x) {
  const at::Tensor h = gate_up(x);
  if (moe.activation == "swigluoai") {
    return down(swigluoai_and_mul(h, moe.swiglu_alpha, moe.swiglu_limit));
  }
  return down(moe.activation == "gelu_pytorch_tanh" ? layer_ops::gelu_tanh_and_mul(h)
                                                   : layer_ops::silu_and_mul(h));
}

// out[rows[i]] += weights[i] * y[i] over [R, H] rows of y (x's dtype) into float32 out.
template <typename T>
void add_weighted(float* out, const at::Tensor& y, const std::vector<int64_t>& rows,
                  const std::vector<float>& weights) {
  const int64_t hidden = y.size(1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const T* src = y.data_ptr<T>() + i * y.stride(0);
    float* dst = out + rows[i] * hidden;
    const float w = weights[i];
    for (int64_t h = 0; h < hidden; ++h) dst[h] += w * static_cast<float>(src[h]);
  }
}

void add_weighted(float* out, const at::Tensor& y, const std::vector<int64_t>& rows,
                  const std::vector<float>& weights) {
  if (y.scalar_type() == at::kFloat) {
    add_weighted<float>(out, y, rows, weights);
  } else {
    add_weighted<c10::BFloat16>(out, y, rows, weights);
  }
}

// The shared expert's gate per token: sigmoid of x . shared_gate in x's dtype.
std::vector<float> shared_gates(const at::Tensor& x, const at::Tensor& gate) {
  std::vector<float> gates(x.size(0));
  for (int64_t t = 0; t < x.size(0); ++t) {
    const float logit = x.scalar_type() == at::kFloat
        ? dot(x.data_ptr<float>() + t * x.stride(0), gate.data_ptr<float>(), x.size(1))
        : dot(x.data_ptr<c10::BFloat16>() + t * x.stride(0), gate.data_ptr<float>(), x.size(1));
    gates[t] = 1.f / (1.f + std::exp(-as_dtype(logit, x.scalar_type())));
  }
  return gates;
}

}  // namespace

at::Tensor swigluoai_and_mul(const at::Tensor& h, double alpha, double limit) {
  TORCH_CHECK(h.dim() == 2 && h.size(1) % 2 == 0 && h.stride(1) == 1 &&
                  (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16),
              "swigluoai_and_mul: float32 or bfloat16 [T, 2I] rows expected");
  at::Tensor out = at::empty({h.size(0), h.size(1) / 2}, h.options());
  if (h.scalar_type() == at::kFloat) {
    swigluoai_rows<float>(h, out, static_cast<float>(alpha), static_cast<float>(limit));
  } else {
    swigluoai_rows<c10::BFloat16>(h, out, static_cast<float>(alpha), static_cast<float>(limit));
  }
  return out;
}

void MoeLayer::check() const {
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.is_contiguous(),
              "moe: the router must be contiguous float32 [E, H]");
  const int64_t experts = router.size(0);
  TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh" ||
                  activation == "swigluoai",
              "moe: unknown activation ", activation);
  TORCH_CHECK(!router_bias || (router_bias->scalar_type() == at::kFloat &&
                               router_bias->is_contiguous() && router_bias->numel() == experts),
              "moe: the router bias must be contiguous float32 [E]");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe: top_k ", top_k, " of ", experts, " experts");
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == experts &&
                  static_cast<int64_t>(down.size()) == experts,
              "moe: ", gate_up.size(), " gate_up and ", down.size(), " down projections for ",
              experts, " experts");
  TORCH_CHECK(routed_tokens.scalar_type() == at::kLong && routed_tokens.numel() == experts,
              "moe: routed_tokens must be int64 [E]");
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() &&
                  shared_gate_up.has_value() == shared_gate.has_value(),
              "moe: a shared expert needs its gate_up, down and gate");
  for (const auto* linears : {&gate_up, &down})
    for (const StackLinear& linear : *linears)
      TORCH_CHECK(StackLinear::known_kind(linear.kind), "moe: unknown projection kind ",
                  linear.kind);
}

at::Tensor MoeLayer::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == router.size(1) && x.stride(1) == 1,
              "moe: x must be [T, ", router.size(1), "] rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "moe: x must be float32 or bfloat16");
  const int64_t tokens = x.size(0), experts = router.size(0), k = top_k;
  at::Tensor out = at::zeros({tokens, x.size(1)}, x.options().dtype(at::kFloat));
  if (tokens == 0) return out.to(x.scalar_type());
  const Routes routes = route(*this, x);
  // (token, weight) lists per expert, tokens in order
  std::vector<std::vector<int64_t>> rows(experts);
  std::vector<std::vector<float>> weights(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      rows[routes.expert[t * k + j]].push_back(t);
      weights[routes.expert[t * k + j]].push_back(routes.weight[t * k + j]);
    }
  }
  int64_t* counts = routed_tokens.data_ptr<int64_t>();
  float* sum = out.data_ptr<float>();
  for (int64_t e = 0; e < experts; ++e) {
    if (rows[e].empty()) continue;
    counts[e] += static_cast<int64_t>(rows[e].size());
    const bool every_token = static_cast<int64_t>(rows[e].size()) == tokens;
    const at::Tensor input = every_token
        ? x
        : x.index_select(0, at::tensor(rows[e], at::TensorOptions().dtype(at::kLong)));
    add_weighted(sum, expert_mlp(*this, gate_up[e], down[e], input), rows[e], weights[e]);
  }
  if (shared_gate_up) {
    std::vector<int64_t> all(tokens);
    std::iota(all.begin(), all.end(), 0);
    add_weighted(sum, expert_mlp(*this, *shared_gate_up, *shared_down, x), all,
                 shared_gates(x, *shared_gate));
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace kvserve
