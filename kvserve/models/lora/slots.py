"""Each projection's adapters, stacked in slots, and the slot each of a step's rows runs.

A projection of several parts (Q, K and V; gate and up) takes one A per part: the slot holds
the parts' A matrices stacked ([parts * max_rank, in]) and a block-diagonal B, stored
transposed ([parts * max_rank, out]), so one pair of products applies every part's adapter to
its own output rows. The step's rows carry their slot (-1: the base model) and one call per
projection applies every adapter of the step (the segmented, punica-style batching): the
compiled kernel `lora_add_` (kernels/csrc/lora.cpp, every ISA level) groups the rows by slot
itself, and the decode stack calls it after the same projection; a prompt's chunk, a run of
more rows of one adapter than the autotuner's limit for the shape, takes two dense GEMMs inside
the same call. The torch reference groups them with a gather and a scatter per adapter. The product is added before a row-parallel
layer's all-reduce (the partial sums of the delta add up like the base's).
"""

from __future__ import annotations

import torch

from kvserve.distributed.sharding import ShardRule, take_shard
from kvserve.kernels import autotune

# the dtypes the compiled kernel takes; others (float16) run the torch reference
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class LoRABatch:
    """This step's LoRA slot per token row (int32, -1: the base model), set by the runner
    before the forward; None when no request of the step runs an adapter."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None

    def set(self, slots: torch.Tensor | None) -> None:
        self.slots = slots

    @property
    def active(self) -> bool:
        return self.slots is not None


class LinearLoRA:
    """One projection's adapter slots: a [slots, parts * max_rank, in] and b (B transposed)
    [slots, parts * max_rank, out]."""

    def __init__(self, layer, num_slots: int, max_rank: int, dtype: torch.dtype,
                 batch: LoRABatch, ops):
        from kvserve.kernels import reference

        self.layer = layer
        self.max_rank = max_rank
        self.batch = batch
        width = len(layer.parts) * max_rank
        self.a = torch.zeros(num_slots, width, layer.in_features, dtype=dtype)
        self.b = torch.zeros(num_slots, width, layer.out_features, dtype=dtype)
        self.compiled = ops is not None and ops.compiled and dtype in KERNEL_DTYPES
        self._lora_add = ops.lora_add_ if self.compiled else reference.lora_add_
        # rows of one adapter's run the kernel's tiles take; a longer run (a prompt's chunk)
        # takes two GEMMs: measured per shape on this CPU, set later by the background tuner
        self.max_rows = autotune.NO_LIMIT
        if self.compiled and autotune.enabled():
            self.max_rows = _tuned_max_rows(ops, width, layer.in_features, layer.out_features,
                                            dtype, self)

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """One part's adapter (the whole model's A [rank, in] and B [rows, rank]), cut to this
        rank's columns and rows as the base weight is."""
        from kvserve.models.layers.linear import reorder_head_rows

        layer = self.layer
        spec = layer.parts[part]
        if spec.reorder_heads and layer.head_order is not None:
            b = reorder_head_rows(b, layer.head_order)
        b = take_shard(b, None if spec.rows is None else ShardRule(0, spec.rows))
        a = take_shard(a, layer.input_rule)
        rank, start = a.shape[0], part * self.max_rank
        offsets = layer.part_offsets()
        self.a[slot, start:start + rank] = a.to(self.a.dtype)
        self.b[slot, start:start + rank, offsets[part]:offsets[part + 1]] = b.T.to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter's x @ A.T @ B.T (the rows of no adapter unchanged)."""
        if self.compiled:
            self._lora_add(x, out, self.a, self.b, self.batch.slots, self.max_rows)
        else:
            self._lora_add(x, out, self.a, self.b, self.batch.slots)


def _tuned_max_rows(ops, width: int, in_features: int, out_features: int, dtype: torch.dtype,
                    owner: LinearLoRA) -> int:
    """The most rows of one adapter for which the kernel's tiles beat its GEMMs (oneDNN: AMX
    where the CPU has it) on this shape, from the autotuner (kernels/autotune.py: the table,
    else NO_LIMIT until the background tuner has measured it). Why measured: on a Xeon with AMX
    the GEMMs won from ~100 rows of QKV's shape at bf16 and never at float32 on 1,536 inputs;
    another CPU moves both."""
    split = width * in_features

    def call(gemm_rows: int):
        def run(x: torch.Tensor, packed: torch.Tensor, *_):
            a = packed[:split].view(1, width, in_features)
            b = packed[split:].view(1, width, out_features)
            out = torch.zeros(x.shape[0], out_features, dtype=x.dtype)
            ops.lora_add_(x, out, a, b, torch.zeros(x.shape[0], dtype=torch.int32), gemm_rows)
            return out
        return run

    packed = (torch.randn(width * (in_features + out_features)) * 0.02).to(dtype)
    return autotune.max_rows(f"lora{width}", call(autotune.NO_LIMIT), packed,
                             torch.empty(out_features, in_features, device="meta"), dtype,
                             ops.isa, autotune.NO_LIMIT, prefill=True, owner=owner,
                             rival=call(0))
