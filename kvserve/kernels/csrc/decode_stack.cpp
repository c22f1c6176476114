// A stage's decoder layers in one call: see decode_stack.h for why. Each instruction calls the
// function the Python path's op set calls, with the same arguments, so outputs are identical;
// the Python side (models/decode_stack.py) records the program from the layers' own forwards
// and decides per step whether the stack applies; `--enforce-eager` turns it off.
#include "decode_stack.h"

#include "bf16_gemm.h"
#include "flash_attention.h"
#include "gguf_gemm.h"
#include "int4_gemm.h"
#include "layer_ops.h"
#include "q8_dot_gemm.h"

namespace kvserve {
namespace {

bool known_kind(const std::string& kind) {
  return kind == "dense" || kind == "int4_q8" || kind == "int4" || kind == "bf16" ||
         kind == "gguf" || kind == "concat";
}

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
                                in.softcap);
  }
  if (step.flash_seq_ids.numel()) {
    flash_attention_(qkv, kv_cache, out, step.flash_seq_ids, step.query_start_loc,
                     step.seq_lens, step.block_tables, in.num_heads, in.num_kv_heads,
                     in.head_dim, in.scale, in.sliding_window, in.softcap);
  }
  return out;
}

}  // namespace

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (kind == "concat") {
    std::vector<at::Tensor> outputs;
    for (const StackLinear& segment : segments) outputs.push_back(segment(x));
    return at::cat(outputs, -1);
  }
  if (kind == "gguf") {
    return x.size(0) > max_rows ? gguf_linear_dequant(x, panels, qtype, bias, out_features)
                                : gguf_linear_q8(x, panels, qtype, bias, out_features);
  }
  if (kind == "dense" || x.size(0) > max_rows) return at::linear(x, dense, bias);
  if (kind == "int4_q8") return int4_linear_q8(x, panels, bias, out_features);
  if (kind == "int4") return int4_linear(x, panels, bias, out_features);
  if (kind == "bf16") return bf16_linear(x, panels, bias, out_features);
  TORCH_CHECK(false, "decode stack: unknown projection kind ", kind);
}

DecodeStack::DecodeStack(std::vector<StackInstruction> program, int64_t num_registers,
                         int64_t output)
    : program_(std::move(program)), num_registers_(num_registers), output_(output) {
  TORCH_CHECK(output >= 0 && output < num_registers, "decode stack: output register ", output,
              " of ", num_registers);
  for (const StackInstruction& in : program_) {
    for (int64_t r : {in.dst, in.src, in.aux})
      TORCH_CHECK(r < num_registers, "decode stack: register ", r, " of ", num_registers);
    TORCH_CHECK(in.op != StackOp::kLinear || known_kind(in.linear.kind),
                "decode stack: unknown projection kind ", in.linear.kind);
  }
}

at::Tensor DecodeStack::run(at::Tensor residual, const at::Tensor& positions,
                            const at::Tensor& slot_mapping, const at::Tensor& seq_ids,
                            const at::Tensor& flash_seq_ids, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables) const {
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
        regs[in.dst] = in.linear(regs[in.src]);
        break;
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
    }
  }
  return regs[output_];
}

}  // namespace kvserve
