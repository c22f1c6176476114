"""The engine's quantization choice, as each layer's method: decided per projection when the
model is built, from the mode and, for a GGUF, how the file stores that projection's tensors.

- `none`: float weights in the activation dtype (`FloatMethod`).
- `int4`, `int8`, `w4a8`, `w8a8`: our formats, converted from float one layer at a time
  (`ConvertMethod`).
- `fp8`: e4m3 codes with a scale per 128x128 block (a block-scaled fp8 checkpoint's own, or
  made from float weights), held as Q8_0 for our int8 kernels (`Fp8Method`, quant/fp8.py).
- `gguf`: the file's own block types where our kernels keep them (`StoredMethod`: Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); float tensors stay float; a block type we have no kernel
  for (Q2_K, Q3_K, the IQ types) is converted to w4a8 (4-bit codes, int8 activations) rather
  than expanded to float.

The LM head: int8 in every converting mode, the file's type under `gguf`, bf16 panels in
unquantized bfloat16.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext
from kvserve.kernels.reference import GGUF_FORMATS
from kvserve.quant.linear import (
    Bf16PanelLinear,
    _has_vector_kernels,
    _quantized_head,
)
from kvserve.quant.fp8 import Fp8Method, Fp8Preparation
from kvserve.quant.methods import ConvertMethod, FloatMethod, LinearMethod, _as_linear
from kvserve.quant.modes import QUANTIZATION_MODES
from kvserve.quant.stored import STORED_TYPES, StoredLinear, StoredMethod, pack_segments
from kvserve.weights.quantized_rows import QuantizedRows

FLOAT_TYPES = ("F32", "F16", "BF16")
FP8_TYPE = "F8_E4M3"  # safetensors' name of an fp8 checkpoint's quantized weights
# bytes a value of a projection held as Q8_0 (fp8's blocks, re-expressed for our kernels)
Q8_0_BYTES = 34 / 32
# what a block type without a kernel of ours becomes under `gguf`
UNKEPT_TYPE_MODE = "w4a8"


class QuantPolicy:
    def __init__(self, mode: str, dtype: torch.dtype, kernels=None,
                 parallel: ParallelContext | None = None,
                 source_types: dict[str, str] | None = None, pack_cache=None):
        """`source_types`: checkpoint tensor name -> how the file stores it (a GGUF's
        GGMLQuantizationType names; an fp8 checkpoint's safetensors dtypes; empty for another
        HF directory). `pack_cache`: where `gguf`
        mode's stored projections find their panels packed already (quant/pack_cache.py)."""
        if mode not in QUANTIZATION_MODES:
            raise ValueError(f"Unknown quantization {mode!r}; choose one of "
                             f"{', '.join(QUANTIZATION_MODES)}")
        if mode in ("w8a8", "int4", "w4a8", "gguf", "fp8") and kernels is None:
            from kvserve.kernels import get_ops

            kernels = get_ops(True)
        self.mode, self.dtype, self.kernels, self.parallel = mode, dtype, kernels, parallel
        self.source_types = source_types or {}
        # a block-scaled fp8 checkpoint (its safetensors dtypes name fp8 weights)
        self.fp8_checkpoint = FP8_TYPE in set(self.source_types.values())
        self.pack_cache = pack_cache

    def stored_type(self, name: str) -> str | None:
        """The block type the file keeps checkpoint tensor `name` in, when the layer keeps it
        too (`gguf` mode and a type our kernels run), else None."""
        stored = self.source_types.get(name)
        return stored if self.mode == "gguf" and stored in STORED_TYPES else None

    def method(self, prefix: str, names: list[str], row_parallel: bool = False) -> LinearMethod:
        """The method of the projection under `prefix` fed by checkpoint tensors `names`
        (relative to it: its parts', and the fused one's where a checkpoint fuses them)."""
        mode = self.mode
        if mode == "none" or (mode == "fp8" and self.kept_float(prefix, names)):
            return FloatMethod(self.dtype, self.kernels)
        if mode == "fp8":
            return Fp8Method(self.dtype, self.kernels)
        if mode == "gguf":
            types = {self.source_types.get(f"{prefix}.{name}.weight") for name in names} - {None}
            if types and types <= set(STORED_TYPES):
                return StoredMethod(self.dtype, self.kernels, self.pack_cache)
            if types <= set(FLOAT_TYPES):
                return FloatMethod(self.dtype, self.kernels)
            mode = UNKEPT_TYPE_MODE
        return ConvertMethod(mode, self.dtype, self.kernels, self.parallel, row_parallel)

    def kept_float(self, prefix: str, names: list[str]) -> bool:
        """An fp8 checkpoint stores this projection in float (a module it leaves unquantized,
        as DeepSeek's and Qwen's `modules_to_not_convert`): fp8 mode keeps it so."""
        if not self.fp8_checkpoint:
            return False
        types = {self.source_types.get(f"{prefix}.{name}.weight") for name in names} - {None}
        return bool(types) and FP8_TYPE not in types

    def prepare(self, tensors, loaders: dict):
        """Checkpoint tensors as the layers take them: fp8 ones as their fp8 projections'
        Q8_0 rows, or as float values elsewhere (quant/fp8.py); the rest as they come."""
        if self.mode != "fp8" and not self.fp8_checkpoint:
            return tensors
        return Fp8Preparation().tensors(tensors, loaders)

    def resident_bytes(self, name: str, numel: int, projection: bool) -> float:
        """About how many bytes checkpoint tensor `name` (`numel` values) holds once loaded,
        for the load-time memory check: a kept block type its panels' bytes; a converted
        projection its low-bit panels plus the dense copy in the activation dtype that serves
        large batches; anything else (norms, embeddings, float projections) the dtype's."""
        element = torch.finfo(self.dtype).bits / 8
        stored = self.stored_type(name)
        if stored is not None:
            values, _, panel_bytes = GGUF_FORMATS[stored]
            return numel * panel_bytes / (16 * values)
        mode = self.mode
        if mode == "gguf":
            source = self.source_types.get(name)
            mode = "none" if source is None or source in FLOAT_TYPES else UNKEPT_TYPE_MODE
        if mode == "fp8" and projection and self.source_types.get(name, FP8_TYPE) == FP8_TYPE:
            return numel * Q8_0_BYTES
        if not projection or mode in ("none", "fp8"):
            return numel * element
        low_bit = 1.0 if mode in ("int8", "w8a8") else 0.5 + 2 * 4 / 32
        return numel * (element + low_bit)

    def head_impl(self, weight) -> nn.Module | None:
        """The LM head's layer from its weights [vocab rows, hidden] as read (None: a plain
        F.linear on the weights as held)."""
        if isinstance(weight, QuantizedRows):
            if self.mode == "gguf" and weight.qtype in STORED_TYPES:
                return StoredLinear(pack_segments([weight], self.kernels, self.pack_cache),
                                    None, weight.cols, self.kernels, self.dtype)
            weight = weight.dequantize()
        linear = _as_linear(weight.float(), None)
        if self.mode != "none":
            return _quantized_head(linear, self.mode, self.dtype, self.kernels)
        if self.dtype == torch.bfloat16 and _has_vector_kernels(self.kernels) and \
                linear.in_features % 32 == 0:
            return Bf16PanelLinear(linear, self.dtype, self.kernels)
        return None
