"""Weights kept as the file stores them: a GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
Q6_K blocks, packed for our kernels (kernels/csrc/gguf_layouts.h) at the file's own bits per
weight, never dequantized and re-quantized to another grid.

A projection's parts may be stored in different types (a Q4_K_M file keeps some V projections
in Q6_K beside Q4_K queries and keys): consecutive parts of one type are packed together, each
such segment multiplied by its own kernel into its columns of the output. Calls up to the
tuned row limit take the integer-dot kernels (`gguf_linear_int`: activations rounded to int8
per group of 32, or, for K-quant calls of 8 rows or more, per super-block of 256 as llama.cpp's
Q8_K); larger ones dequantize slabs of rows into the activation dtype and run the dense GEMM
(`gguf_linear_dequant`), so no dense copy of the weights is ever kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.kernels import autotune
from kvserve.kernels.reference import GGUF_FORMATS
from kvserve.kernels.reference import INT4_PANEL as PANEL_ROWS  # rows a panel interleaves
from kvserve.quant.methods import LinearMethod, part_rows
from kvserve.weights.quantized_rows import QuantizedRows

# the block types our kernels keep as stored
STORED_TYPES = tuple(GGUF_FORMATS)
# rows up to which the integer-dot kernels serve a call (the dequantized GEMM above) until the
# autotuner has measured the shape, where the dequantizing path has AMX tiles (bfloat16
# activations): measured on an Emerald Rapids Xeon, Llama-3.2-1B's Q4_K shapes, the q8 kernel
# beats dequantize + bf16 GEMM up to 64-128 rows (1.1-1.6x at 64), float32 up to 256+; at 16
# (the earlier limit) a 32-request decode batch took the dequantizing path: s2 0.55x
STORED_KERNEL_MAX_ROWS = 64


def untuned_max_rows(kernels, dtype: torch.dtype) -> int:
    """The row limit of a shape the autotuner has not measured yet (it measures only when the
    engine is idle, so a busy server can run a new model's prefill this way for minutes). The
    dequantizing path wins large batches only on AMX tiles; without them its GEMM runs on the
    same vector units at the float or bf16 rate, below the integer dot products' (Zen 5, the
    Llama-3.2-3B shapes at 512 rows: 114 ms a gate_up call dequantizing against 45 ms, and the
    tuner's own tables give q8 every size up to 1024 rows), so the integer kernel takes every
    batch until measured otherwise."""
    amx = getattr(kernels, "gguf_amx_usable", None)
    if dtype == torch.bfloat16 and amx is not None and amx():
        return STORED_KERNEL_MAX_ROWS
    return autotune.NO_LIMIT


@dataclass
class Segment:
    """Consecutive output rows stored in one type: their panels, and where they go."""

    qtype: str
    panels: torch.Tensor
    rows: int
    start: int  # first output column


class StoredLinear(nn.Module):
    """y = x W.T (+ b) over W held in the file's block types, one segment per run of parts of a
    type (usually one)."""

    def __init__(self, segments: list[Segment], bias: torch.Tensor | None, in_features: int,
                 kernels, dtype: torch.dtype = torch.float32, max_rows: int | None = None):
        """`dtype`: the activations' (what the autotuner times the kernels with); `max_rows`:
        the integer kernel's row limit before the autotuner's (default: untuned_max_rows)."""
        super().__init__()
        self.segments = segments
        for index, segment in enumerate(segments):  # buffers: they move and count as the model's
            self.register_buffer(f"panels_{index}", segment.panels)
        self.register_buffer("bias", bias)
        self.in_features = in_features
        self.out_features = sum(segment.rows for segment in segments)
        self.kernels = kernels
        self.activation_dtype = dtype
        self.max_rows = untuned_max_rows(kernels, dtype) if max_rows is None else max_rows
        if len(segments) == 1 and getattr(kernels, "compiled", False):
            self.max_rows = self._tuned_max_rows(segments[0], kernels, self.max_rows)

    def _tuned_max_rows(self, segment: Segment, kernels, fallback: int) -> int:
        """The autotuner's row limit for this type and shape: the q8 kernel against the
        dequantizing GEMM on the same panels, activations in the layer's dtype."""
        qtype, rows, dtype = segment.qtype, segment.rows, self.activation_dtype

        def q8(x, panels, bias, out_features):
            return kernels.gguf_linear_int(x, panels, qtype, bias, out_features)

        def dequant(x, panels):
            return kernels.gguf_linear_dequant(x, panels, qtype, None, rows)

        shape = torch.empty(rows, self.in_features, device="meta")
        return autotune.max_rows(f"gguf_{qtype}", q8, segment.panels, shape, dtype,
                                 kernels.isa, fallback, prefill=True, owner=self, rival=dequant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.gguf_linear_int if x.shape[0] <= self.max_rows \
            else self.kernels.gguf_linear_dequant
        if len(self.segments) == 1:
            segment = self.segments[0]
            return kernel(x, segment.panels, segment.qtype, self.bias, segment.rows)
        outputs = [kernel(x, segment.panels, segment.qtype,
                          None if self.bias is None else
                          self.bias[segment.start:segment.start + segment.rows], segment.rows)
                   for segment in self.segments]
        return torch.cat(outputs, dim=-1)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of W (an embedding lookup), dequantized to dtype: one segment only."""
        segment = self.segments[0]
        return self.kernels.gguf_dequantize(segment.panels, segment.qtype, index,
                                            self.in_features, dtype)


def pack_segments(parts: list[QuantizedRows], kernels, cache=None) -> list[Segment]:
    """The parts' rows (in order) packed into one segment per run of a type (`cache`: a
    quant.pack_cache.PackCache that may hold them packed already)."""
    segments: list[Segment] = []
    start, run = 0, []
    for part in parts + [None]:
        if run and (part is None or part.qtype != run[0].qtype):
            rows = sum(piece.shape[0] for piece in run)
            panels = _pack_run(run, kernels) if cache is None else \
                cache.panels(run, lambda parts: _pack_run(parts, kernels))
            segments.append(Segment(run[0].qtype, panels, rows, start))
            start += rows
            run = []
        if part is not None:
            run.append(part)
    return segments


def _pack_run(run: list[QuantizedRows], kernels) -> torch.Tensor:
    """One type's parts (Q, K and V; gate and up) as one tensor's panels. Each part is packed
    straight from the file's map into its run of panels where the parts before it fill whole
    panels (16 rows, as every real model's do); joining the bytes first was a third of a
    load's time."""
    first = run[0]
    if len(run) == 1 or any(part.shape[0] % PANEL_ROWS for part in run[:-1]):
        rows = QuantizedRows.cat(run) if len(run) > 1 else first
        return kernels.gguf_pack(rows.bytes(), rows.qtype)
    block_values, _, panel_block_bytes = GGUF_FORMATS[first.qtype]
    total = sum(part.shape[0] for part in run)
    panels = torch.empty(-(-total // PANEL_ROWS), first.cols // block_values, panel_block_bytes,
                         dtype=torch.uint8)
    offset = 0
    for part in run:
        count = -(-part.shape[0] // PANEL_ROWS)
        kernels.gguf_pack(part.bytes(), part.qtype, panels[offset:offset + count])
        offset += count
    return panels


class StoredMethod(LinearMethod):
    """A projection whose parts are all in types our kernels keep (`STORED_TYPES`)."""

    def __init__(self, dtype: torch.dtype, kernels, pack_cache=None):
        self.dtype, self.kernels, self.pack_cache = dtype, kernels, pack_cache

    def create_weights(self, layer):
        layer.impl = None
        layer.staged = {}

    def load_part(self, layer, part, kind, tensor):
        if kind == "weight":
            if not isinstance(tensor, QuantizedRows):
                raise TypeError(f"a stored-format projection got a {type(tensor).__name__}, "
                                "not a quantized tensor")
            layer.staged[part] = tensor
            return
        if "bias" not in layer.staged:
            layer.staged["bias"] = torch.empty(layer.out_features, dtype=self.dtype)
        layer.staged["bias"][part_rows(layer, part)].copy_(tensor)

    def finish(self, layer):
        parts = [layer.staged[index] for index in range(len(layer.parts))]
        layer.impl = StoredLinear(pack_segments(parts, self.kernels, self.pack_cache),
                                  layer.staged.get("bias"),
                                  layer.in_features, self.kernels, self.dtype)
        layer.staged = {}

    def apply(self, layer, x):
        return layer.impl.forward(x)

    def stack_linear(self, layer, kernels):
        return stored_stack_linear(kernels, layer.impl)


def stored_stack_linear(kernels, impl: StoredLinear):
    """The decode stack's StackLinear of a stored projection: one "gguf" kernel a segment,
    a "concat" of them for several (with each its slice of the bias, as `forward`)."""
    parts = [kernels.StackLinear(
        "gguf", segment.panels, segment.panels,
        None if impl.bias is None or len(impl.segments) == 1 else
        impl.bias[segment.start:segment.start + segment.rows],
        segment.rows, impl.max_rows, segment.qtype) for segment in impl.segments]
    if len(parts) == 1:
        segment = impl.segments[0]
        return kernels.StackLinear("gguf", segment.panels, segment.panels, impl.bias,
                                   segment.rows, impl.max_rows, segment.qtype)
    empty = impl.segments[0].panels.new_empty(0)
    return kernels.StackLinear("concat", empty, empty, None, impl.out_features, 0, "", parts)
