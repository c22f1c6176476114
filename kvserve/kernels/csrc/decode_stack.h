// A stage's decoder layers as one call: a program of the ops the layers' Python forwards call,
// recorded once from those forwards (models/decode_stack.py) and run here (decode_stack.cpp).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "lora.h"
#include "moe.h"
#include "stack_linear.h"

namespace kvserve {

// The ops a layer may record. Registers hold the step's tensors: register 0 is the stack's
// input (the embedded tokens, the residual stream), the others values the ops produce.
enum class StackOp : int64_t {
  kRmsNorm = 0,      // dst = rms_norm(src)
  kAddRmsNorm = 1,   // aux += src; src = rms_norm(aux)   (in place, as add_rms_norm_)
  kLinear = 2,       // dst = linear(src)
  kSiluAndMul = 3,   // dst = silu(gate) * up of src
  kGeluAndMul = 4,   // dst = tanh-gelu(gate) * up of src
  kNormHeads = 5,    // QK-norm of src's query and key heads, in place
  kAttention = 6,    // RoPE and cache write on src (fused QKV), then dst = attention
  kAdd = 7,          // src += aux (in place)
  kNormProjections = 8,  // RMSNorm over src's whole query and key projections, in place
  kClamp = 9,        // src clamped to [-limit, limit], in place
  kMoe = 10,         // dst = the mixture of experts `moe` over src
};

struct StackInstruction {
  StackOp op = StackOp::kRmsNorm;
  int64_t dst = -1, src = -1, aux = -1;
  // norms: weight (kNormHeads: the query norm's; key_weight the key norm's), eps, offset
  at::Tensor weight, key_weight;
  double eps = 0.0, weight_offset = 0.0;
  StackLinear linear;
  // kLinear's LoRA slots (models/lora/slots.py), undefined without --enable-lora: a [S, W, K]
  // and b [S, W, N], filled in place as adapters load; runs of more rows of one adapter than
  // lora_gemm_rows take the GEMMs (lora.h)
  at::Tensor lora_a, lora_b;
  int64_t lora_gemm_rows = kNoGemm;
  // attention: the layer's cache and RoPE table, heads, scale, window, soft cap
  at::Tensor kv_cache, cos_sin;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, sliding_window = 0;
  double scale = 1.0, softcap = 0.0;
  at::Tensor sinks;  // undefined, or each query head's learned sink logit (gpt-oss)
  double limit = 0.0;  // kClamp's
  std::shared_ptr<MoeLayer> moe;
};

// Runs the program for a step whose every sequence takes the paged attention kernel or, in
// bfloat16 over a bf16 cache, the flash kernel (the Python side decides per step). Every op is
// the function the Python path calls with the same arguments, so the outputs are the same to
// the bit, without ~9 Python calls per layer.
class DecodeStack {
 public:
  DecodeStack(std::vector<StackInstruction> program, int64_t num_registers, int64_t output);

  // residual: the embedded tokens [T, H] (register 0, updated in place as the Python path
  // does); lora_slots: each row's LoRA slot (int32, -1: none), when the step runs adapters;
  // returns register `output`.
  at::Tensor run(at::Tensor residual, const at::Tensor& positions,
                 const at::Tensor& slot_mapping, const at::Tensor& seq_ids,
                 const at::Tensor& flash_seq_ids, const at::Tensor& query_start_loc,
                 const at::Tensor& seq_lens, const at::Tensor& block_tables,
                 const c10::optional<at::Tensor>& lora_slots = c10::nullopt) const;

 private:
  std::vector<StackInstruction> program_;
  int64_t num_registers_, output_;
};

}  // namespace kvserve
