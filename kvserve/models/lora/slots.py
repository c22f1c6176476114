"""Each projection's adapters, stacked in slots, and the slot each of a step's rows runs.

A projection of several parts (Q, K and V; gate and up) takes one A per part: the slot holds
the parts' A matrices stacked ([parts * max_rank, in]) and a block-diagonal B, stored
transposed ([parts * max_rank, out]), so one pair of products applies every part's adapter to
its own output rows. The step's rows carry their slot (-1: the base model) and one call per
projection applies every adapter of the step (the segmented, punica-style batching): the
compiled kernel `lora_add_` (kernels/csrc/lora.cpp, every ISA level) groups the rows by slot
itself, and the decode stack calls it after the same projection; the torch reference groups
them with a gather and a scatter per adapter. The product is added before a row-parallel
layer's all-reduce (the partial sums of the delta add up like the base's).
"""

from __future__ import annotations

import torch

from kvserve.distributed.sharding import ShardRule, take_shard

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
        self._lora_add(x, out, self.a, self.b, self.batch.slots)
