// A stage's decoder layers in one call: see decode_stack.h for why. Each instruction calls the
// function the Python path's op set calls, with the same arguments, so outputs are identical;
// the Python side (models/decode_stack.py) records the program from the layers' own forwards
// and decides per step whether the stack applies; `--enforce-eager` turns it off.
#include "decode_stack.h"

#include <tuple>

#include "flash_attention.h"
#include "layer_ops.h"
#include "lora.h"

namespace kvserve {
namespace {

// Step inputs every attention instruction reads.
struct StepArgs {
  const at::Tensor& positions;
  const at::Tensor& slot_mapping;
  const at::Tensor& seq_ids;
  const at::Tensor& flash_seq_ids;
  const at::Tensor& query_start_loc;
  const at::Tensor& seq_lens;
  const at::Tensor& block_tables;
};

at::Tensor attend(const StackInstruction& in, at::Tensor& qkv, const StepArgs& step) {
  at::Tensor kv_cache = in.kv_cache;
  layer_ops::rope_and_cache_(qkv, step.positions, in.cos_sin, kv_cache, step.slot_mapping,
                             in.num_heads, in.num_kv_heads, in.head_dim);
  at::Tensor out = at::empty({qkv.size(0), in.num_heads * in.head_dim}, qkv.options());
  if (step.seq_ids.numel()) {
    layer_ops::paged_attention_(qkv, kv_cache, out, step.seq_ids, step.query_start_loc,
                                step.seq_lens, step.block_tables, in.num_heads,
                                in.num_kv_heads, in.head_dim, in.scale, in.sliding_window,
                                in.softcap,
                                in.sinks.defined() ? c10::optional<at::Tensor>(in.sinks)
                                                   : c10::nullopt);
  }
  if (step.flash_seq_ids.numel()) {
    flash_attention_(qkv, kv_cache, out, step.flash_seq_ids, step.query_start_loc,
                     step.seq_lens, step.block_tables, in.num_heads, in.num_kv_heads,
                     in.head_dim, in.scale, in.sliding_window, in.softcap);
  }
  return out;
}

// OLMoE's QK-norm: one RMSNorm over all query heads, one over all key heads (as
// LayerOps.norm_projections_: each part normalised contiguous and copied back).
void norm_projections_(const StackInstruction& in, at::Tensor& qkv) {
  const int64_t q_size = in.num_heads * in.head_dim, kv_size = in.num_kv_heads * in.head_dim;
  for (const auto& [begin, size, weight] :
       {std::tuple{int64_t{0}, q_size, in.weight}, std::tuple{q_size, kv_size, in.key_weight}}) {
    at::Tensor part = qkv.narrow(1, begin, size);
    part.copy_(layer_ops::rms_norm(part.contiguous(), weight, in.eps, in.weight_offset));
  }
}

}  // namespace

DecodeStack::DecodeStack(std::vector<StackInstruction> program, int64_t num_registers,
                         int64_t output)
    : program_(std::move(program)), num_registers_(num_registers), output_(output) {
  TORCH_CHECK(output >= 0 && output < num_registers, "decode stack: output register ", output,
              " of ", num_registers);
  for (const StackInstruction& in : program_) {
    for (int64_t r : {in.dst, in.src, in.aux})
      TORCH_CHECK(r < num_registers, "decode stack: register ", r, " of ", num_registers);
    TORCH_CHECK(in.op != StackOp::kLinear || StackLinear::known_kind(in.linear.kind),
                "decode stack: unknown projection kind ", in.linear.kind);
    TORCH_CHECK(in.op != StackOp::kMoe || in.moe,
                "decode stack: a MoE instruction without its layer");
  }
}

at::Tensor DecodeStack::run(at::Tensor residual, const at::Tensor& positions,
                            const at::Tensor& slot_mapping, const at::Tensor& seq_ids,
                            const at::Tensor& flash_seq_ids, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables,
                            const c10::optional<at::Tensor>& lora_slots) const {
  const StepArgs step{positions, slot_mapping, seq_ids, flash_seq_ids, query_start_loc,
                      seq_lens, block_tables};
  std::vector<at::Tensor> regs(num_registers_);
  regs[0] = residual;
  for (const StackInstruction& in : program_) {
    switch (in.op) {
      case StackOp::kRmsNorm:
        regs[in.dst] = layer_ops::rms_norm(regs[in.src], in.weight, in.eps, in.weight_offset);
        break;
      case StackOp::kAddRmsNorm:
        layer_ops::add_rms_norm_(regs[in.src], regs[in.aux], in.weight, in.eps,
                                 in.weight_offset);
        break;
      case StackOp::kLinear:
      {
        const at::Tensor x = regs[in.src];  // dst may reuse src's register
        regs[in.dst] = in.linear(x);
        if (lora_slots && in.lora_a.defined())
          lora_add_(x, regs[in.dst], in.lora_a, in.lora_b, *lora_slots, in.lora_gemm_rows);
        break;
      }
      case StackOp::kSiluAndMul:
        regs[in.dst] = layer_ops::silu_and_mul(regs[in.src]);
        break;
      case StackOp::kGeluAndMul:
        regs[in.dst] = layer_ops::gelu_tanh_and_mul(regs[in.src]);
        break;
      case StackOp::kNormHeads:
        layer_ops::rms_norm_heads_(regs[in.src], in.weight, in.key_weight, in.num_heads,
                                   in.num_kv_heads, in.head_dim, in.eps, in.weight_offset);
        break;
      case StackOp::kAttention:
        regs[in.dst] = attend(in, regs[in.src], step);
        break;
      case StackOp::kAdd:
        regs[in.src].add_(regs[in.aux]);
        break;
      case StackOp::kNormProjections:
        norm_projections_(in, regs[in.src]);
        break;
      case StackOp::kClamp:
        regs[in.src].clamp_(-in.limit, in.limit);
        break;
      case StackOp::kMoe:
        regs[in.dst] = in.moe->forward(regs[in.src]);
        break;
    }
  }
  return regs[output_];
}

}  // namespace kvserve
