"""fp8 weights (`--quantization fp8`, and the default for a block-scaled fp8 checkpoint): each
projection as e4m3 codes with one scale per 128x128 block, as DeepSeek-V3/R1 and Qwen3-FP8
ship them, run by our int8 kernels.

x86 CPUs before AVX10.2 have no fp8 arithmetic, so a kernel reading fp8 codes would widen each
to float before multiplying. The fp8 values are instead re-expressed once, at load, in GGUF's
Q8_0 (int8 codes, one fp16 scale per 32 values along a row: 8.5 bits a weight against fp8's
8.06), which our integer-dot kernels, the decode stack and the fused MoE already run at every
ISA level (VNNI where the CPU has it). The re-expression is close: each group of 32 gets a
scale of its own absmax / 127, finer than e4m3's 3-bit mantissa for every value above 1/16 of
the group's absmax; the perplexity it costs is measured in docs/performance-journal.md.

The conversion happens between the checkpoint and the layers (`Fp8Preparation`), on whole
tensors, so every tensor-parallel rank takes its rows and columns of the same Q8_0 blocks: TP
gives one process's numbers. fp8 tensors that do not feed an fp8 projection (DeepSeek's
kv_b_proj, which latent attention splits per head; a quantization mode other than fp8) are
handed on as their exact float values.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from kvserve.errors import CorruptModelFileError
from kvserve.kernels.reference import quantize_int8_groupwise
from kvserve.quant.stored import StoredMethod
from kvserve.weights.fp8_checkpoint import Fp8Weight, quantize_fp8_blocks
from kvserve.weights.quantized_rows import QuantizedRows

DEFAULT_BLOCK = (128, 128)  # what --quantization fp8 makes of float weights (DeepSeek's)
Q8_GROUP = 32


class Fp8Method(StoredMethod):
    """A projection whose weights are fp8 blocks, held as Q8_0 rows (`Fp8Preparation` has
    converted them before they reach the layer)."""

    def load_part(self, layer, part, kind, tensor):
        if kind == "weight" and not isinstance(tensor, QuantizedRows):
            raise TypeError(f"an fp8 projection got a {type(tensor).__name__}, not the Q8_0 "
                            "rows of its fp8 blocks")
        super().load_part(layer, part, kind, tensor)


def is_fp8_projection(loader: tuple | None) -> bool:
    """A model loader (CausalLM.checkpoint_loaders) is the weight of an fp8 projection."""
    return loader is not None and loader[0] == "linear" and loader[3] == "weight" and \
        isinstance(loader[1].method, Fp8Method)


class Fp8Preparation:
    """Checkpoint tensors on their way to the layers: an fp8 projection's weight as the Q8_0
    rows of its fp8 blocks (the checkpoint's blocks, or `block`-sized ones made from float
    weights), every other fp8 tensor as its float values."""

    def __init__(self, block: tuple[int, int] | None = None):
        self.block = tuple(block or DEFAULT_BLOCK)

    def tensors(self, tensors: Iterable[tuple[str, object]], loaders: dict
                ) -> Iterator[tuple[str, object]]:
        for name, tensor in tensors:
            if is_fp8_projection(loaders.get(name)):
                yield name, fp8_as_q8_0(self._fp8(name, tensor), name)
            elif isinstance(tensor, Fp8Weight):
                yield name, tensor.dequantize()
            else:
                yield name, tensor

    def _fp8(self, name: str, tensor) -> Fp8Weight:
        if isinstance(tensor, Fp8Weight):
            return tensor
        if isinstance(tensor, QuantizedRows):  # a GGUF's blocks: their values, then fp8
            tensor = tensor.dequantize()
        elif not isinstance(tensor, torch.Tensor):  # a lazy safetensors slice
            tensor = tensor[:]
        return quantize_fp8_blocks(tensor, self.block, name)


def fp8_as_q8_0(weight: Fp8Weight, name: str = "") -> QuantizedRows:
    """The fp8 weight's values as GGUF Q8_0 rows: per group of 32 along a row, d = absmax / 127
    (stored in fp16), codes round(value / d) (kernels/reference.py's groupwise int8)."""
    rows, cols = weight.shape
    if cols % Q8_GROUP:
        raise CorruptModelFileError(
            f"checkpoint tensor {name!r} has {cols} columns, not a multiple of {Q8_GROUP}: its "
            "fp8 blocks cannot be held in our int8 groups; load it with --quantization none")
    codes, scale = quantize_int8_groupwise(weight.dequantize(), Q8_GROUP)
    codes = codes.view(rows, cols // Q8_GROUP, Q8_GROUP)
    scale = scale.unsqueeze(-1)
    blocks = torch.cat([scale.half().view(torch.uint8), codes.view(torch.uint8)], -1)
    return QuantizedRows("Q8_0", blocks.reshape(rows, -1).numpy(), cols, Q8_GROUP, name)
