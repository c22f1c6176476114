// GGUF K-quant linear layers on AMX tiles (gguf_amx.cpp): bfloat16 activations, the file's
// weights dequantized panel by panel into bfloat16 tiles, float32 sums.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace kvserve {

// Whether gguf_linear_amx runs here: a build with AVX512-BF16, a CPU with AMX-TILE and AMX-BF16,
// Linux granting this process the tile state, and the switch on (KVSERVE_AMX=0 turns it off;
// set_gguf_amx overrides both ways where the hardware allows).
bool gguf_amx_usable();
void set_gguf_amx(bool enabled);

// Whether gguf_linear_amx takes this format and x: Q4_K, Q5_K or Q6_K, bfloat16 x, AMX usable.
bool gguf_amx_takes(const std::string& qtype, const at::Tensor& x);

// y = x W.T (+ bias) in bfloat16: W's values as gguf_linear_dequant's bfloat16 weights (gguf's
// float32 values rounded to bfloat16, to the bit), products summed in float32 on the tiles.
at::Tensor gguf_linear_amx(const at::Tensor& x, const at::Tensor& panels, const std::string& qtype,
                           const c10::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace kvserve
