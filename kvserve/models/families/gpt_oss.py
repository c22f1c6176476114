"""gpt-oss (OpenAI's open-weight mixtures of experts): Llama's pre-norm block with biases on Q,
K, V and the output projection, a learned sink logit per query head in each attention softmax,
sliding-window and full attention alternating (`layer_types`), YaRN RoPE, and every MLP a
mixture of experts: a router with a bias, the top k of its logits softmaxed (the same weights as
a softmax over all renormalised over the top k), and experts with biases and the clamped
"swigluoai" activation (models/layers/mlp.py).

HF checkpoints stack each layer's experts in single tensors, transposed ([E, in, out]) and with
gate and up interleaved column by column (`mlp.experts.gate_up_proj`, `..._bias`,
`down_proj`, `..._bias`), and name the router `mlp.router`: `checkpoint_tensors` splits them
into the per-expert projections every mixture here holds. llama.cpp's converter writes the
experts apart already (`ffn_{gate,up,down}_exps`, config/builtin_families.py names them).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from kvserve.errors import CorruptModelFileError
from kvserve.models.families.moe import MoEForCausalLM

_STACKED = re.compile(r"(model\.layers\.\d+\.mlp)\.(experts\.(gate_up_proj|down_proj)(_bias)?"
                      r"|router\.(weight|bias))$")


class GptOssForCausalLM(MoEForCausalLM):
    def attention_options(self, config):
        return {"output_bias": config.attention_output_bias, "sinks": config.attention_sinks}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterator:
        for name, tensor in weights:
            match = _STACKED.match(name)
            if match is None:
                yield name, tensor
            elif not self.holds(name):  # another pipeline stage's layer: not read at all
                continue
            elif match[5] is not None:  # the router
                yield f"{match[1]}.gate.{match[5]}", tensor
            else:
                yield from self._split_experts(match[1], match[3], match[4] is not None,
                                               tensor)

    def _split_experts(self, prefix: str, projection: str, is_bias: bool,
                       tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """One stacked experts tensor as each expert's projections in our layout ([out, in],
        gate and up apart)."""
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        config = self.full_config
        hidden, width = config.hidden_size, config.moe_intermediate_size
        inputs, outputs = (hidden, 2 * width) if projection == "gate_up_proj" else (width, hidden)
        expected = (config.num_experts, outputs) if is_bias else \
            (config.num_experts, inputs, outputs)
        kind = "bias" if is_bias else "weight"
        name = f"{prefix}.experts.{projection}{'_bias' if is_bias else ''}"
        if tuple(whole.shape) != expected:
            raise CorruptModelFileError(f"checkpoint tensor {name!r} has shape "
                                        f"{list(whole.shape)}, the config (gpt_oss) gives "
                                        f"{list(expected)}")
        for expert in range(config.num_experts):
            own = whole[expert] if is_bias else whole[expert].t()
            base = f"{prefix}.experts.{expert}"
            if projection == "down_proj":
                yield f"{base}.down_proj.{kind}", own.contiguous()
            else:  # gate and up interleaved: even outputs the gate's, odd the up's
                yield f"{base}.gate_proj.{kind}", own[0::2].contiguous()
                yield f"{base}.up_proj.{kind}", own[1::2].contiguous()
