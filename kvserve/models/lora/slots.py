"""Each projection's adapters, stacked in slots, and the rows of a step each slot runs on.

A projection of several parts (Q, K and V; gate and up) takes one A per part: the slot holds
the parts' A matrices stacked ([parts * max_rank, in]) and a block-diagonal B ([out, parts *
max_rank]), so one pair of matmuls applies every part's adapter to its own output rows. The
step's rows are grouped by slot (the segmented, punica-style batching): for each adapter in
the step, its rows' x @ A.T @ B.T is added to the base projection's output, before a
row-parallel layer's all-reduce (the partial sums of the delta add up like the base's).
"""

from __future__ import annotations

import torch

from kvserve.distributed.sharding import ShardRule, take_shard


class LoRABatch:
    """This step's rows per adapter slot (set by the runner before the forward); empty when
    no request of the step runs an adapter."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor | slice] = {}

    def set(self, rows: dict[int, torch.Tensor | slice]) -> None:
        self.rows = rows

    @property
    def active(self) -> bool:
        return bool(self.rows)


class LinearLoRA:
    """One projection's adapter slots."""

    def __init__(self, layer, num_slots: int, max_rank: int, dtype: torch.dtype,
                 batch: LoRABatch):
        self.layer = layer
        self.max_rank = max_rank
        self.batch = batch
        width = len(layer.parts) * max_rank
        self.a = torch.zeros(num_slots, width, layer.in_features, dtype=dtype)
        self.b = torch.zeros(num_slots, layer.out_features, width, dtype=dtype)

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
        self.b[slot, offsets[part]:offsets[part + 1], start:start + rank] = b.to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each slot's rows' x @ A.T @ B.T."""
        for slot, rows in self.batch.rows.items():
            a, b = self.a[slot], self.b[slot]
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ a.T) @ b.T
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
