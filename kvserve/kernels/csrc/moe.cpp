// The fused mixture of experts (moe.h). Why in C++: the Python loop (models/layers/moe.py's
// `run`) made ~40 op calls an active expert (gathers, index_add_, dtype casts) and a bf16
// router GEMV through oneDNN at ~0.2 ms; at batch 1 on OLMoE-1B-7B (16 layers, top 8) that was
// ~60 ms of a ~105 ms step (torch.profiler, Emerald Rapids). Here routing is a few float dot
// products, tokens are grouped by expert, each active expert runs the projection kernels the
// Python path would call (StackLinear: the same stored formats and row limits) over its own
// tokens only, so at batch 1 only the chosen experts' weights are read; experts with an
// integer-dot kernel run grouped, one parallel region a projection (below).
#include "moe.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include <omp.h>

#include "layer_ops.h"
#include "q8_rows.h"
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

// Indices [0, n) sorted by value, descending, ties to the lower index (torch's stable sort).
void rank_descending(const std::vector<float>& value, std::vector<int64_t>& order, int64_t n,
                     int64_t first) {
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + first, order.end(), [&](int64_t a, int64_t b) {
    return value[a] > value[b] || (value[a] == value[b] && a < b);
  });
}

// DeepSeek's routing of one token from its float32 router logits (moe.h: group_limited).
void route_group_limited(const MoeLayer& moe, std::vector<float>& score, int64_t t,
                         Routes& routes) {
  const int64_t experts = static_cast<int64_t>(score.size()), k = moe.top_k;
  const int64_t per_group = experts / moe.groups;
  const bool sigmoid = moe.scoring == "sigmoid";
  std::vector<float> choice(experts);
  if (sigmoid) {
    const float* bias = moe.correction_bias ? moe.correction_bias->data_ptr<float>() : nullptr;
    for (int64_t e = 0; e < experts; ++e) {
      score[e] = 1.f / (1.f + std::exp(-score[e]));
      choice[e] = score[e] + (bias ? bias[e] : 0.f);
    }
  } else {
    const float peak = *std::max_element(score.begin(), score.end());
    float sum = 0.f;
    for (float& s : score) sum += (s = std::exp(s - peak));
    for (int64_t e = 0; e < experts; ++e) choice[e] = score[e] /= sum;
  }
  std::vector<float> rating(moe.groups);
  std::vector<int64_t> order;
  for (int64_t g = 0; g < moe.groups; ++g) {
    const float* first = choice.data() + g * per_group;
    if (sigmoid) {  // the sum of the group's best two
      std::vector<float> members(first, first + per_group);
      const int64_t two = std::min<int64_t>(2, per_group);
      std::partial_sort(members.begin(), members.begin() + two, members.end(),
                        std::greater<float>());
      rating[g] = two == 2 ? members[0] + members[1] : members[0];
    } else {
      rating[g] = *std::max_element(first, first + per_group);
    }
  }
  rank_descending(rating, order, moe.groups, moe.topk_groups);
  std::vector<bool> kept(moe.groups, false);
  for (int64_t j = 0; j < moe.topk_groups; ++j) kept[order[j]] = true;
  for (int64_t e = 0; e < experts; ++e)
    if (!kept[e / per_group]) choice[e] = sigmoid ? -INFINITY : 0.f;
  rank_descending(choice, order, experts, k);
  float chosen = 0.f;
  for (int64_t j = 0; j < k; ++j) chosen += score[order[j]];
  const bool renormalise = sigmoid && moe.normalize_top_k;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = order[j];
    const float weight = sigmoid ? score[e] : choice[e];
    routes.expert[t * k + j] = e;
    routes.weight[t * k + j] =
        static_cast<float>((renormalise ? weight / (chosen + 1e-20f) : weight) *
                           moe.routed_scaling);
  }
}

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
    if (moe.group_limited) {  // float32 logits, DeepSeek's choice
      for (int64_t e = 0; e < experts; ++e)
        probabilities[e] = dot(row, router + e * hidden, hidden);
      route_group_limited(moe, probabilities, t, routes);
      continue;
    }
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

// The experts' activation over [T, 2I] rows [gate | up] -> [T, I].
at::Tensor activate(const MoeLayer& moe, const at::Tensor& h) {
  if (moe.activation == "swigluoai")
    return swigluoai_and_mul(h, moe.swiglu_alpha, moe.swiglu_limit);
  return moe.activation == "gelu_pytorch_tanh" ? layer_ops::gelu_tanh_and_mul(h)
                                               : layer_ops::silu_and_mul(h);
}

at::Tensor expert_mlp(const MoeLayer& moe, const StackLinear& gate_up, const StackLinear& down,
                      const at::Tensor& x) {
  return down(activate(moe, gate_up(x)));
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

// ---- every active expert at once (prefill: a 256-token prompt gives each of 128 experts ~16
// rows). One projection call an expert cost a parallel region, x quantized again and an output
// allocated each: 1,536 calls a Qwen3-30B-shaped prefill. Here the (token, slot) pairs are
// sorted by expert, x is quantized once, and each projection is one parallel region over every
// expert's panels (a Qwen3-shape layer at 256 tokens: 89 -> 63-70 ms, Emerald Rapids); experts
// whose rows exceed their kernel's row limit (or whose projections have no span kernel) run
// their projections' own calls, as the loop did.

// The (token, slot) pairs sorted by expert: expert e's rows are [first[e], first[e + 1]), its
// tokens in order (the loop's order); slots[t k + j]: token t's rows, experts ascending.
struct Grouping {
  std::vector<int64_t> first, token, slots;
  std::vector<float> weight;

  int64_t rows(int64_t e) const { return first[e + 1] - first[e]; }
};

Grouping group_by_expert(const Routes& routes, int64_t tokens, int64_t experts, int64_t k) {
  Grouping g;
  g.first.assign(experts + 1, 0);
  for (int64_t e : routes.expert) ++g.first[e + 1];
  std::partial_sum(g.first.begin(), g.first.end(), g.first.begin());
  std::vector<int64_t> next(g.first.begin(), g.first.end() - 1);
  g.token.resize(tokens * k);
  g.weight.resize(tokens * k);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = next[routes.expert[t * k + j]]++;
      g.token[row] = t;
      g.weight[row] = routes.weight[t * k + j];
    }
  }
  std::vector<int64_t> filled(tokens, 0);
  g.slots.resize(tokens * k);
  for (int64_t row = 0; row < tokens * k; ++row) {
    const int64_t t = g.token[row];
    g.slots[t * k + filled[t]++] = row;
  }
  return g;
}

// Sorted rows' codes as the experts' kernels want them: per group (narrow) and, where some
// expert's kernel takes super-blocks (SpanKernel::step_groups), per super-block (wide).
struct RowCodes {
  const q8::QuantizedRows* narrow;
  const q8::QuantizedRows* wide;
  const q8::QuantizedRows& of(const SpanKernel& kernel) const {
    return kernel.step_groups > 1 ? *wide : *narrow;
  }
};

// One projection of the grouped experts: each expert's span kernel over its rows, outputs into
// the sorted rows of `out` (bias added in float, x's dtype), the panels of every expert split
// over the threads by cost (an expert's panel costs its rows plus one for the unpacking).
struct GroupedProjection {
  const std::vector<StackLinear>& linears;
  const std::vector<int64_t>& grouped;  // the experts, ascending
  const Grouping& grouping;
  std::vector<at::Tensor> biases;  // float32, per grouped expert (undefined: none)

  GroupedProjection(const std::vector<StackLinear>& linears, const std::vector<int64_t>& grouped,
                    const Grouping& grouping)
      : linears(linears), grouped(grouped), grouping(grouping) {
    for (int64_t e : grouped)
      biases.push_back(linears[e].bias ? linears[e].bias->to(at::kFloat).contiguous()
                                       : at::Tensor());
  }

  int64_t panels(int64_t e) const { return (linears[e].out_features + 15) / 16; }
  int64_t panel_cost(int64_t e) const { return grouping.rows(e) + 1; }

  int64_t total_cost() const {
    int64_t total = 0;
    for (int64_t e : grouped) total += panels(e) * panel_cost(e);
    return total;
  }

  // expert e's kernel for its rows (super-block or per-group activations, as a call of that
  // many rows through gguf_linear_int: the same bits as the per-expert calls)
  SpanKernel kernel(int64_t e) const { return linears[e].span_kernel(grouping.rows(e)); }
  bool any_wide() const {
    return std::any_of(grouped.begin(), grouped.end(),
                       [&](int64_t e) { return kernel(e).step_groups > 1; });
  }

  // Thread `thread` of `team`: the panels whose cost starts in its share.
  void run_share(const RowCodes& codes, at::Tensor& out, int64_t thread, int64_t team,
                 int64_t total) const {
    const int64_t low = total * thread / team, high = total * (thread + 1) / team;
    int64_t start = 0;
    for (size_t i = 0; i < grouped.size(); ++i) {
      const int64_t e = grouped[i], cost = panel_cost(e), count = panels(e);
      auto first_at = [&](int64_t bound) {
        return std::clamp<int64_t>((bound - start + cost - 1) / cost, 0, count);
      };
      const int64_t begin = first_at(low), end = first_at(high);
      start += count * cost;
      if (begin >= end) continue;
      q8::OutputRows y;
      y.ld = out.size(1);
      if (biases[i].defined()) y.bias = biases[i].data_ptr<float>();
      if (out.scalar_type() == at::kFloat) {
        y.f32 = out.data_ptr<float>();
      } else {
        y.bf16 = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
      }
      const StackLinear& linear = linears[e];
      const SpanKernel span = kernel(e);
      span.run(codes.of(span), q8::PanelSpan{grouping.first[e], grouping.first[e + 1], begin, end},
               linear.panels, linear.out_features, y);
    }
  }
};

template <typename T>
void quantize_rows(q8::QuantizedRows& q, const at::Tensor& x, q8::CodeOrder order,
                   int64_t begin, int64_t end) {
  q8::quantize_groups(q, x.data_ptr<T>(), x.stride(0), order, begin, end);
}

void quantize_share(q8::QuantizedRows& q, const at::Tensor& x, q8::CodeOrder order,
                    int64_t thread, int64_t team) {
  const int64_t units = q.units(x.size(0));
  const int64_t begin = units * thread / team, end = units * (thread + 1) / team;
  x.scalar_type() == at::kFloat ? quantize_rows<float>(q, x, order, begin, end)
                                : quantize_rows<c10::BFloat16>(q, x, order, begin, end);
}

// Rows [first, last) of x into q: its units of those rows only.
void quantize_row_range(q8::QuantizedRows& q, const at::Tensor& x, q8::CodeOrder order,
                        int64_t first, int64_t last) {
  const int64_t begin = q.units(first), end = q.units(last);
  x.scalar_type() == at::kFloat ? quantize_rows<float>(q, x, order, begin, end)
                                : quantize_rows<c10::BFloat16>(q, x, order, begin, end);
}

// Sorted row `row` of `dst` = token `token`'s row of `src` (codes and per-group terms).
void copy_row(q8::QuantizedRows& dst, int64_t row, const q8::QuantizedRows& src, int64_t token) {
  std::memcpy(dst.codes.data() + row * dst.cols, src.codes.data() + token * src.cols, src.cols);
  const int64_t g = src.groups;
  std::copy_n(src.step.data() + token * g, g, dst.step.data() + row * g);
  std::copy_n(src.sum.data() + token * g, g, dst.sum.data() + row * g);
  std::copy_n(src.code_sum.data() + token * g, g, dst.code_sum.data() + row * g);
  std::copy_n(src.half_sum.data() + token * g, g, dst.half_sum.data() + row * g);
  if (src.step_groups > 1) {
    std::copy_n(src.sum32.data() + token * g, g, dst.sum32.data() + row * g);
    std::copy_n(src.sum16.data() + 2 * token * g, 2 * g, dst.sum16.data() + 2 * row * g);
    std::copy_n(src.seed16.data() + 2 * token * g, 2 * g, dst.seed16.data() + 2 * row * g);
  }
}

// The experts that run grouped: active, both projections with a span kernel (one code order
// per projection across them, one width) and no more rows than their row limits.
std::vector<int64_t> grouped_experts(const MoeLayer& moe, const Grouping& grouping,
                                     SpanKernel& gate_up_kernel, SpanKernel& down_kernel) {
  std::vector<int64_t> grouped;
  if (!moe.grouped) return grouped;
  for (int64_t e = 0; e < static_cast<int64_t>(moe.gate_up.size()); ++e) {
    const int64_t rows = grouping.rows(e);
    const StackLinear &gate_up = moe.gate_up[e], &down = moe.down[e];
    const SpanKernel first = gate_up.span_kernel(rows), second = down.span_kernel(rows);
    if (rows == 0 || !first.run || !second.run || rows > gate_up.max_rows ||
        rows > down.max_rows)
      continue;
    if (grouped.empty()) {
      gate_up_kernel = first, down_kernel = second;
    } else if (first.order != gate_up_kernel.order || second.order != down_kernel.order ||
               gate_up.out_features != moe.gate_up[grouped[0]].out_features ||
               down.out_features != moe.down[grouped[0]].out_features) {
      continue;
    }
    grouped.push_back(e);
  }
  return grouped;
}

// body(thread, team) on a team of up to at::get_num_threads() threads (no more than `work`).
template <typename Body>
void in_parallel(int64_t work, Body body) {
  at::internal::lazy_init_num_threads();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work));
#pragma omp parallel num_threads(threads)
  body(omp_get_thread_num(), omp_get_num_threads());
}

// The grouped experts' gate_up outputs [T k, 2I] in x's dtype: x's tokens quantized once, their
// rows copied to the grouped experts' sorted rows, every expert's panels in one region. Rows of
// the other experts are zero.
at::Tensor grouped_gate_up(const MoeLayer& moe, const at::Tensor& x, const Grouping& grouping,
                           const std::vector<int64_t>& grouped, const SpanKernel& kernel) {
  const int64_t sorted = static_cast<int64_t>(grouping.token.size());
  const GroupedProjection gate_up{moe.gate_up, grouped, grouping};
  const bool wide = gate_up.any_wide();
  thread_local q8::QuantizedRows by_token, by_row, wide_by_token, wide_by_row;
  q8::QuantizedRows &xq = by_token, &rows = by_row, &wxq = wide_by_token, &wrows = wide_by_row;
  q8::size_rows(xq, x.size(0), x.size(1));
  q8::size_rows(rows, sorted, x.size(1));
  if (wide) {
    q8::size_rows(wxq, x.size(0), x.size(1), q8::kSuperBlockGroups);
    q8::size_rows(wrows, sorted, x.size(1), q8::kSuperBlockGroups);
  }
  at::Tensor h = at::empty({sorted, moe.gate_up[grouped[0]].out_features}, x.options());
  if (grouped.size() < moe.gate_up.size()) h.zero_();
  std::vector<std::pair<int64_t, bool>> copied;  // the grouped experts' sorted rows, wide or not
  for (int64_t e : grouped) {
    const bool e_wide = gate_up.kernel(e).step_groups > 1;
    for (int64_t row = grouping.first[e]; row < grouping.first[e + 1]; ++row)
      copied.emplace_back(row, e_wide);
  }
  const int64_t cost = gate_up.total_cost(), count = static_cast<int64_t>(copied.size());
  in_parallel(cost, [&](int64_t thread, int64_t team) {
    quantize_share(xq, x, kernel.order, thread, team);
    if (wide) quantize_share(wxq, x, kernel.order, thread, team);
#pragma omp barrier
    for (int64_t i = count * thread / team; i < count * (thread + 1) / team; ++i) {
      const auto [row, row_wide] = copied[i];
      copy_row(row_wide ? wrows : rows, row, row_wide ? wxq : xq, grouping.token[row]);
    }
#pragma omp barrier
    gate_up.run_share(RowCodes{&rows, &wrows}, h, thread, team, cost);
  });
  return h;
}

// The grouped experts' down outputs into their sorted rows of y, from the activations (each
// expert's rows quantized as its kernel wants them).
void grouped_down(const MoeLayer& moe, const at::Tensor& activated, const Grouping& grouping,
                  const std::vector<int64_t>& grouped, const SpanKernel& kernel, at::Tensor& y) {
  thread_local q8::QuantizedRows hidden_rows, wide_hidden_rows;
  q8::QuantizedRows &hq = hidden_rows, &whq = wide_hidden_rows;
  q8::size_rows(hq, activated.size(0), activated.size(1));
  const GroupedProjection down{moe.down, grouped, grouping};
  const bool wide = down.any_wide();
  if (wide) q8::size_rows(whq, activated.size(0), activated.size(1), q8::kSuperBlockGroups);
  const int64_t cost = down.total_cost();
  in_parallel(cost, [&](int64_t thread, int64_t team) {
    if (!wide) {
      quantize_share(hq, activated, kernel.order, thread, team);
    } else {  // each thread a share of every grouped expert's rows, in that expert's buffer
      for (int64_t e : grouped) {
        const int64_t first = grouping.first[e], rows = grouping.rows(e);
        quantize_row_range(down.kernel(e).step_groups > 1 ? whq : hq, activated, kernel.order,
                           first + rows * thread / team, first + rows * (thread + 1) / team);
      }
    }
#pragma omp barrier
    down.run_share(RowCodes{&hq, &whq}, y, thread, team, cost);
  });
}

// Every sorted row's expert output [T k, H] in x's dtype: the grouped experts' in two parallel
// regions (gate_up; down), the others' through their projections' own calls.
at::Tensor expert_outputs(const MoeLayer& moe, const at::Tensor& x, const Grouping& grouping) {
  const int64_t experts = static_cast<int64_t>(moe.gate_up.size());
  at::Tensor y = at::empty({static_cast<int64_t>(grouping.token.size()), x.size(1)}, x.options());
  SpanKernel gate_up_kernel, down_kernel;
  const std::vector<int64_t> grouped = grouped_experts(moe, grouping, gate_up_kernel, down_kernel);
  if (!grouped.empty()) {
    const at::Tensor h = grouped_gate_up(moe, x, grouping, grouped, gate_up_kernel);
    grouped_down(moe, activate(moe, h), grouping, grouped, down_kernel, y);
  }
  size_t next = 0;  // the others, through their own calls
  for (int64_t e = 0; e < experts; ++e) {
    if (next < grouped.size() && grouped[next] == e) {
      ++next;
      continue;
    }
    const int64_t begin = grouping.first[e], end = grouping.first[e + 1];
    if (begin == end) continue;
    const bool every_token = end - begin == x.size(0);
    const at::Tensor input = every_token
        ? x
        : x.index_select(0, at::tensor(std::vector<int64_t>(grouping.token.begin() + begin,
                                                            grouping.token.begin() + end),
                                       at::TensorOptions().dtype(at::kLong)));
    y.narrow(0, begin, end - begin).copy_(expert_mlp(moe, moe.gate_up[e], moe.down[e], input));
  }
  return y;
}

// out[t] += weight * y[row] over token t's rows, its experts in ascending order (the loop's
// order of the float32 sums), tokens split over the threads.
template <typename T>
void combine_rows(float* out, const at::Tensor& y, const Grouping& grouping, int64_t k) {
  const int64_t hidden = y.size(1), tokens = static_cast<int64_t>(grouping.slots.size()) / k;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = out + t * hidden;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = grouping.slots[t * k + j];
        const T* src = y.data_ptr<T>() + row * hidden;
        const float w = grouping.weight[row];
        for (int64_t h = 0; h < hidden; ++h) dst[h] += w * static_cast<float>(src[h]);
      }
    }
  });
}

void combine(float* out, const at::Tensor& y, const Grouping& grouping, int64_t k) {
  y.scalar_type() == at::kFloat ? combine_rows<float>(out, y, grouping, k)
                                : combine_rows<c10::BFloat16>(out, y, grouping, k);
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
                  (shared_gate_up.has_value() || !shared_gate.has_value()),
              "moe: a shared expert needs its gate_up and down (its gate is optional)");
  TORCH_CHECK(!group_limited ||
                  ((scoring == "softmax" || scoring == "sigmoid") && groups >= 1 &&
                   experts % groups == 0 && topk_groups >= 1 && topk_groups <= groups &&
                   top_k <= topk_groups * (experts / groups)),
              "moe: group-limited routing needs softmax or sigmoid scoring, groups dividing the ",
              experts, " experts, and top_k within the kept groups");
  TORCH_CHECK(!correction_bias || (correction_bias->scalar_type() == at::kFloat &&
                                   correction_bias->is_contiguous() &&
                                   correction_bias->numel() == experts),
              "moe: the correction bias must be contiguous float32 [E]");
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
  const int64_t tokens = x.size(0), experts = router.size(0);
  at::Tensor out = at::zeros({tokens, x.size(1)}, x.options().dtype(at::kFloat));
  if (tokens == 0) return out.to(x.scalar_type());
  const Grouping grouping = group_by_expert(route(*this, x), tokens, experts, top_k);
  int64_t* counts = routed_tokens.data_ptr<int64_t>();
  for (int64_t e = 0; e < experts; ++e) counts[e] += grouping.rows(e);
  const at::Tensor y = expert_outputs(*this, x, grouping);
  combine(out.data_ptr<float>(), y, grouping, top_k);
  if (shared_gate_up) {
    std::vector<int64_t> all(tokens);
    std::iota(all.begin(), all.end(), 0);
    add_weighted(out.data_ptr<float>(), expert_mlp(*this, *shared_gate_up, *shared_down, x), all,
                 shared_gate ? shared_gates(x, *shared_gate) : std::vector<float>(tokens, 1.f));
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace kvserve
