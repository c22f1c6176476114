"""Projections that know, from construction, how they are loaded, sharded and stored.

A linear layer is made of parts (Q, K and V of a fused QKV projection; gate and up), each fed by
its own checkpoint tensor or by a slice of a fused one. Each part carries the rows this
tensor-parallel rank takes of it, and the layer the columns it takes (row-parallel layers cut
the input features and all-reduce their partial sums). How the weights are held and multiplied
is the layer's `LinearMethod`, chosen when the model is built (kvserve/quant/methods.py: float,
our int4/int8/w4a8/w8a8 conversions): the model never swaps modules by attribute name.

Loading: the model maps each checkpoint name to (layer, part) through `checkpoint_names()` and
hands the tensor to `load`; the layer takes its rank's slice, reorders rows where the family
asked (partial rotary's head order), and passes it to its method. When every part (and bias) has
arrived, the method finishes the layer (quantizes, packs), so a model is converted one layer at
a time, never whole in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.distributed.sharding import ShardRule, kv_heads_of_rank, take_shard
from kvserve.quant import LinearMethod, QuantPolicy


@dataclass(frozen=True)
class LinearPart:
    """One output part: its checkpoint name (relative to the layer's parent module), the rows
    the whole model's tensor has, and this rank's rows of it (None: all)."""

    name: str
    full_rows: int
    rows: tuple[tuple[int, int], ...] | None = None
    reorder_heads: bool = False  # partial rotary: each head's rows in the layer's head order

    @property
    def local_rows(self) -> int:
        if self.rows is None:
            return self.full_rows
        return sum(end - start for start, end in self.rows)


class PartitionedLinear(nn.Module):
    """y = x W.T (+ b) with W the parts' rows stacked, through the layer's method."""

    def __init__(self, in_features: int, parts: list[LinearPart], bias: bool,
                 method: LinearMethod, input_rule: ShardRule | None = None,
                 head_order: torch.Tensor | None = None, head_dim: int = 0,
                 fused_name: str | None = None, export_fused: bool = False,
                 full_in_features: int | None = None):
        """`in_features`: this rank's; `input_rule`: the columns a row-parallel rank takes;
        `head_order` (partial rotary) reorders each head_dim rows of the parts marked
        `reorder_heads`; `fused_name`: the checkpoint name of all parts in one tensor (Phi-3's
        qkv_proj; ours for the float method's parameter), `export_fused`: write that one."""
        super().__init__()
        self.in_features = in_features
        self.full_in_features = full_in_features or in_features  # the whole model's
        self.parts = parts
        self.out_features = sum(part.local_rows for part in parts)
        self.has_bias = bias
        self.input_rule = input_rule
        self.head_order = head_order
        self.head_dim = head_dim
        self.fused_name = fused_name
        self.export_fused = export_fused
        self.method = method
        self.lora = None  # its LoRA adapters' slots (models/lora/slots.py), when enabled
        self.tp: ParallelContext | None = None  # row-parallel layers all-reduce their output
        self.adds_bias = True  # a row-parallel layer's bias is added by its first rank only
        self._pending = self._expected()
        method.create_weights(self)

    # ---- loading ---------------------------------------------------------------------------

    def checkpoint_names(self, parent: str, own: str) -> dict[str, tuple[int | None, str]]:
        """Checkpoint tensor name -> (part index or None for all parts, "weight" or "bias")."""
        names = {}
        kinds = ("weight", "bias") if self.has_bias else ("weight",)
        fused = self.fused_name or own
        for kind in kinds:
            if len(self.parts) > 1 or fused != self.parts[0].name:
                names[f"{parent}.{fused}.{kind}"] = (None, kind)
            for index, part in enumerate(self.parts):
                names[f"{parent}.{part.name}.{kind}"] = (index, kind)
        return names

    def missing_names(self, parent: str) -> list[str]:
        """The checkpoint names of the parts (and biases) not loaded yet."""
        return sorted(f"{parent}.{self.parts[part].name}.{kind}" for part, kind in self._pending)

    def load(self, part: int | None, kind: str, tensor) -> None:
        """One checkpoint tensor of the whole model (a torch tensor or a lazy slice): a part's,
        or every part's stacked (part None)."""
        if part is None:
            offsets = [0]
            for spec in self.parts:
                offsets.append(offsets[-1] + spec.full_rows)
            for index in range(len(self.parts)):
                self.load(index, kind, tensor[offsets[index]:offsets[index + 1]])
            return
        spec = self.parts[part]
        if spec.reorder_heads and self.head_order is not None:
            tensor = reorder_head_rows(tensor, self.head_order)
        tensor = take_shard(tensor, None if spec.rows is None else ShardRule(0, spec.rows))
        if kind == "weight":
            tensor = take_shard(tensor, self.input_rule)
        elif not self.adds_bias:  # the ranks' partial sums are added up: one rank's bias
            tensor = torch.zeros(spec.local_rows)
        self.method.load_part(self, part, kind, tensor)
        self._pending.discard((part, kind))
        if not self._pending:
            self.method.finish(self)

    @property
    def loaded(self) -> bool:
        return not self._pending

    def _expected(self) -> set[tuple[int, str]]:
        kinds = ("weight", "bias") if self.has_bias else ("weight",)
        return {(index, kind) for index in range(len(self.parts)) for kind in kinds}

    def part_offsets(self) -> list[int]:
        """Where each part's rows start in this rank's output (and the end)."""
        offsets = [0]
        for part in self.parts:
            offsets.append(offsets[-1] + part.local_rows)
        return offsets

    # ---- running ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        if self.lora is not None and self.lora.batch.active:
            self.lora.add_(x, out)
        if self.tp is not None:
            self.tp.communicator.all_reduce_(out)
        return out

    def hf_tensors(self, parent: str, own: str) -> dict[str, torch.Tensor]:
        """The layer's float weights under checkpoint names, in HF's row order (this rank's
        rows: the whole model's with one rank)."""
        exported = self.method.export(self)
        tensors = {}
        for kind, tensor in exported.items():
            if self.export_fused:
                pieces = [(self.fused_name or own, tensor, None)]
            else:
                offsets = self.part_offsets()
                pieces = [(part.name, tensor[offsets[i]:offsets[i + 1]], part)
                          for i, part in enumerate(self.parts)]
            for name, rows, part in pieces:
                tensors[f"{parent}.{name}.{kind}"] = self._hf_order(rows, part)
        return tensors

    def _hf_order(self, rows: torch.Tensor, part: LinearPart | None) -> torch.Tensor:
        """Rows back in HF's head order (the inverse of `head_order`)."""
        if self.head_order is None:
            return rows.clone()
        inverse = torch.argsort(self.head_order)
        if part is not None:
            return reorder_head_rows(rows, inverse) if part.reorder_heads else rows.clone()
        offsets = self.part_offsets()
        return torch.cat([reorder_head_rows(rows[offsets[i]:offsets[i + 1]], inverse)
                          if p.reorder_heads else rows[offsets[i]:offsets[i + 1]]
                          for i, p in enumerate(self.parts)])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={[p.name for p in self.parts]}, method={type(self.method).__name__}")


def reorder_head_rows(rows, order: torch.Tensor):
    """Each head's head_dim rows (or entries, for a bias) taken in `order`: a torch tensor, a
    lazy safetensors slice (read whole) or a GGUF tensor's quantized rows (moved whole)."""
    if not isinstance(rows, torch.Tensor) and not hasattr(rows, "qtype"):
        rows = rows[:]
    head_dim = order.shape[0]
    index = torch.arange(rows.shape[0]).view(-1, head_dim)[:, order].flatten()
    return rows[index]


def _even_rows(full: int, parallel: ParallelContext | None) -> tuple[tuple[int, int], ...] | None:
    """This rank's share of `full` rows split evenly (None: one rank, all of them)."""
    if parallel is None:
        return None
    share = full // parallel.tp_size
    return ((parallel.tp_rank * share, (parallel.tp_rank + 1) * share),)


def column_parallel(in_features: int, parts: list[tuple[str, int]], bias: bool,
                    quant: QuantPolicy, prefix: str, parallel: ParallelContext | None = None,
                    fused_name: str | None = None, export_fused: bool = False,
                    ) -> PartitionedLinear:
    """Output rows split evenly over the tensor-parallel ranks, part by part (gate and up;
    a single part for a plain projection). `parts`: (checkpoint name, rows of the whole
    model); `prefix`: the parent module's checkpoint prefix."""
    parallel = active(parallel)
    specs = [LinearPart(name, rows, _even_rows(rows, parallel)) for name, rows in parts]
    names = [spec.name for spec in specs] + [fused_name] * (fused_name is not None)
    return PartitionedLinear(in_features, specs, bias, quant.method(prefix, names),
                             fused_name=fused_name, export_fused=export_fused)


def row_parallel(in_features: int, out_features: int, name: str, bias: bool,
                 quant: QuantPolicy, prefix: str,
                 parallel: ParallelContext | None = None) -> PartitionedLinear:
    """Input features split over the ranks (each computes a partial sum, all-reduced)."""
    parallel = active(parallel)
    specs = [LinearPart(name, out_features)]
    columns = _even_rows(in_features, parallel)
    local_in = in_features if columns is None else columns[0][1] - columns[0][0]
    layer = PartitionedLinear(local_in, specs, bias,
                              quant.method(prefix, [name], row_parallel=parallel is not None),
                              input_rule=None if columns is None else ShardRule(1, columns),
                              full_in_features=in_features)
    layer.tp = parallel
    layer.adds_bias = parallel is None or parallel.tp_rank == 0
    return layer


def qkv_parallel(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant: QuantPolicy, prefix: str, parallel: ParallelContext | None = None,
                 head_order: torch.Tensor | None = None, names=("q_proj", "k_proj", "v_proj"),
                 fused_name: str = "qkv_proj", export_fused: bool = False) -> PartitionedLinear:
    """Q, K and V by heads: a rank takes its query heads and the KV heads they read (split when
    the ranks divide them, one replicated head per rank when they are a multiple).
    `num_heads`, `num_kv_heads`: the whole model's."""
    parallel = active(parallel)
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    if parallel is None:
        q_span = kv_span = None
    else:
        per_rank = q_rows // parallel.tp_size
        q_span = ((parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank),)
        first, end = kv_heads_of_rank(num_kv_heads, parallel.tp_size, parallel.tp_rank)
        kv_span = ((first * head_dim, end * head_dim),)
    specs = [LinearPart(names[0], q_rows, q_span, reorder_heads=True),
             LinearPart(names[1], kv_rows, kv_span, reorder_heads=True),
             LinearPart(names[2], kv_rows, kv_span)]
    return PartitionedLinear(hidden_size, specs, bias,
                             quant.method(prefix, [*names, fused_name]),
                             head_order=head_order, head_dim=head_dim, fused_name=fused_name,
                             export_fused=export_fused)
