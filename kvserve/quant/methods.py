"""How a projection's weights are held and multiplied: its `LinearMethod`, chosen when the model
is built (`QuantPolicy.method`), never by swapping modules afterwards.

- `FloatMethod` (`none`): the weights in the activation dtype; in bfloat16 with our vector
  kernels, also laid out for our bf16 decode kernel (Bf16PanelLinear, same values).
- `ConvertMethod` (`int4`, `int8`, `w4a8`, `w8a8`): the layer's float32 weights are staged as
  its parts arrive, then quantized to our formats (quant/linear.py's layers) once the last part
  is in, and the staging dropped: a model is converted one layer at a time.

The LM head has its own policy (`head_impl`): int8 in every quantized mode (a third of a
decode step's bytes once the layers are 4-bit), bf16 panels in bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.communication import all_reduce_max
from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.weights.quantized_rows import QuantizedRows
from kvserve.quant.linear import (
    Bf16PanelLinear,
    Int4WeightOnlyLinear,
    W4A8Linear,
    _has_vector_kernels,
    _quantized,
)


class LinearMethod:
    """How one projection's weights are held and multiplied (models/layers/linear.py calls
    these with the layer; `layer.parts`, `layer.in_features`, `layer.out_features`)."""

    def create_weights(self, layer: nn.Module) -> None:
        """Parameters that exist from construction (the float method's `weight`)."""

    def load_part(self, layer: nn.Module, part: int, kind: str, tensor: torch.Tensor) -> None:
        """This rank's rows of part `part`'s weight or bias (`kind`), in HF's layout."""
        raise NotImplementedError

    def finish(self, layer: nn.Module) -> None:
        """Every part and bias is loaded: build what `apply` runs."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def stack_linear(self, layer: nn.Module, kernels):
        """The projection as the decode stack's StackLinear, or None: not in the stack."""
        return None

    def export(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """The layer's float weight (and bias) for `hf_state_dict`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no float weights to export")


def part_rows(layer: nn.Module, part: int) -> slice:
    offsets = layer.part_offsets()
    return slice(offsets[part], offsets[part + 1])


class FloatMethod(LinearMethod):
    """Unquantized weights in the activation dtype (a `weight` parameter, and `bias`)."""

    def __init__(self, dtype: torch.dtype, kernels=None):
        self.dtype = dtype
        # bf16 weights through our panel kernel for decode rows (oneDNN's bf16 GEMM read weights
        # at ~7 GB/s at one row on Zen 4); the same values, so lossless
        self.bf16_panels = dtype == torch.bfloat16 and _has_vector_kernels(kernels)
        self.kernels = kernels

    def create_weights(self, layer):
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=self.dtype), requires_grad=False)
        bias = torch.empty(layer.out_features, dtype=self.dtype) if layer.has_bias else None
        layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        layer.impl = None

    def load_part(self, layer, part, kind, tensor):
        getattr(layer, kind).data[part_rows(layer, part)].copy_(as_float(tensor))

    def finish(self, layer):
        if self.bf16_panels and layer.in_features % 32 == 0:
            layer.impl = Bf16PanelLinear(_as_linear(layer.weight.data, layer.bias), self.dtype,
                                         self.kernels)

    def apply(self, layer, x):
        if layer.impl is not None:
            return layer.impl.forward(x)
        return F.linear(x, layer.weight, layer.bias)

    def stack_linear(self, layer, kernels):
        return _stack_linear(kernels, layer.impl) if layer.impl is not None else \
            kernels.StackLinear("dense", layer.weight, layer.weight, layer.bias,
                                layer.out_features, 0)

    def export(self, layer):
        tensors = {"weight": layer.weight.data}
        if layer.bias is not None:
            tensors["bias"] = layer.bias.data
        return tensors


class ConvertMethod(LinearMethod):
    """Our quantized formats from the checkpoint's float weights: float32 staging per layer,
    quantized when its last part arrives (quant/linear.py `_quantized`)."""

    def __init__(self, mode: str, dtype: torch.dtype, kernels,
                 parallel: ParallelContext | None = None, row_parallel: bool = False):
        self.mode, self.dtype, self.kernels = mode, dtype, kernels
        self.parallel = active(parallel)
        self.row_parallel = row_parallel

    def create_weights(self, layer):
        layer.impl = None
        layer.staged = {}

    def load_part(self, layer, part, kind, tensor):
        if kind not in layer.staged:
            shape = (layer.out_features, layer.in_features) if kind == "weight" \
                else (layer.out_features,)
            layer.staged[kind] = torch.empty(shape, dtype=torch.float32)
        layer.staged[kind][part_rows(layer, part)].copy_(as_float(tensor))

    def finish(self, layer):
        linear = _as_linear(layer.staged["weight"], layer.staged.get("bias"))
        absmax = None
        if self.parallel is not None and self.row_parallel and \
                self.mode not in ("int4", "w4a8"):  # per-channel int8: the whole row's absmax
            absmax = all_reduce_max(linear.weight.data.abs().amax(1), self.parallel)
        elif self.parallel is not None and self.row_parallel and layer.in_features % 32:
            raise ValueError(
                f"int4 with tensor-parallel size {self.parallel.tp_size}: each rank's slice "
                f"has {layer.in_features} input features, not a multiple of the group size 32; "
                "use int8 or another tensor-parallel size")
        layer.impl = _quantized(linear, self.mode, self.dtype, self.kernels, absmax)
        layer.staged = {}

    def apply(self, layer, x):
        return layer.impl.forward(x)

    def stack_linear(self, layer, kernels):
        return _stack_linear(kernels, layer.impl)


def as_float(tensor) -> torch.Tensor:
    """A checkpoint tensor's values: a GGUF block-quantized one dequantized (gguf's float32)."""
    return tensor.dequantize() if isinstance(tensor, QuantizedRows) else tensor


def _as_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """Weights as an nn.Linear (quant/linear.py's layers are built from one), without copying."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.data if isinstance(bias, nn.Parameter) else bias,
                                   requires_grad=False)
    return linear


def _stack_linear(kernels, impl: nn.Module):
    """A quantized layer as the decode stack's StackLinear (its kernel kind, weights, row
    limit), or None for a kind the stack does not run."""
    if isinstance(impl, W4A8Linear):
        kind = "int4_q8"
    elif isinstance(impl, Bf16PanelLinear):
        kind = "bf16"
    elif isinstance(impl, Int4WeightOnlyLinear) and impl.ops is not None:
        kind = "int4"
    else:  # torch's int4 kernel, int8, w8a8: not in the stack
        return None
    return kernels.StackLinear(kind, impl.panels, impl.dense_weight, impl.bias, impl.out_features,
                               impl.max_rows)
