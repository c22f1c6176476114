"""A mixture of experts in place of a layer's MLP: a router scores the experts per token, each
token runs through its top k (their outputs weighted by the routing weights and summed), and,
where the family has one, a shared expert every token takes (Qwen2-MoE, scaled by a sigmoid
gate).

Each expert is a `GatedMLP` with its own projections, so experts load, shard and quantize as
every projection does (kvserve/quant: float, our int4/int8 conversions): with tensor
parallelism each expert's intermediate dimension is split over the ranks (gate/up by rows, down
by columns), the routed and shared outputs are summed on each rank and all-reduced once. The
router is replicated and kept in the activation dtype, softmax in float32 (HF's order).

The computation runs as one op of the op set (`LayerOps.moe`). With the compiled kernels it is
one C++ call (`fused`: kernels/csrc/moe.cpp's MoeLayer, which the decode stack records as one
instruction): routing, tokens grouped by expert, each active expert's projection kernels over its
tokens only, the weighted sum in float32. Otherwise (the torch reference kernels, a projection
kind with no C++ kernel, or `KVSERVE_FUSED_MOE=0`) `run_loop` does the same in Python over the op
set's projections; both share the routed-token counters.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.models.layers.expert_parallel import AbsentExpert, ExpertParallel
from kvserve.models.layers.mlp import GatedMLP
from kvserve.quant import QuantPolicy


class GateWeight(nn.Module):
    """A gate's weights [rows, hidden] (and bias [rows], gpt-oss's router), replicated on every
    rank: the router's (a row an expert, checkpoint `<moe>.gate.weight`) or the shared expert's
    scalar gate (`<moe>.shared_expert_gate.weight`, one row)."""

    def __init__(self, rows: int, hidden_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 activation: str, quant: QuantPolicy, prefix: str,
                 parallel: ParallelContext | None = None, normalize_top_k: bool = False,
                 shared_intermediate_size: int = 0,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 router_bias: bool = False, expert_bias: bool = False,
                 swiglu: tuple[float, float] = (1.702, 7.0), shared_gated: bool = True):
        """`intermediate_size`: each expert's (the whole model's); `prefix`: the module's
        checkpoint name; `expert_names`: an expert's gate, up and down projections';
        `router_bias`, `expert_bias`: the router and each expert projection have biases
        (gpt-oss); `swiglu`: the swigluoai activation's (alpha, limit); `shared_gated`: the
        shared expert's output scaled by its sigmoid gate (Qwen2-MoE), else added as it is
        (DeepSeek)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.normalize_top_k = normalize_top_k
        self.tp = active(parallel)
        self.gate = GateWeight(num_experts, hidden_size, router_bias)
        # expert parallelism: whole experts per rank, the others absent (expert_parallel.py)
        self.ep = ExpertParallel(self.tp, num_experts, self.tp.redundant_experts) \
            if self.tp is not None and self.tp.expert_parallel else None
        expert_split = None if self.ep is not None else parallel
        self.experts = nn.ModuleList(
            self._expert(hidden_size, intermediate_size, activation, quant,
                         f"{prefix}.experts.{index}", expert_split, expert_names, expert_bias,
                         swiglu) if self.ep is None or self.ep.holds(index) else AbsentExpert()
            for index in range(num_experts))
        # tokens routed to each expert since the model was built (top-k slots: a token counts
        # once per expert it takes); /metrics reads them (`expert_counts`). Made on the first
        # step: the model is built on the meta device.
        self.routed_tokens: torch.Tensor | None = None
        self._fused: tuple | None = None  # (the op set, its MoeLayer or None)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = self._expert(hidden_size, shared_intermediate_size, activation,
                                              quant, f"{prefix}.shared_expert", parallel)
            self.shared_expert_gate = GateWeight(1, hidden_size) if shared_gated else None

    @staticmethod
    def _expert(hidden_size, intermediate_size, activation, quant, prefix, parallel,
                names=("gate_proj", "up_proj", "down_proj"), bias=False,
                swiglu=(1.702, 7.0)) -> GatedMLP:
        expert = GatedMLP(hidden_size, intermediate_size, activation, quant, prefix, parallel,
                          names=names, bias=bias, swiglu=swiglu)
        expert.down_proj.tp = None  # the layer all-reduces the sum of every expert's, once
        return expert

    def forward(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        return ops.moe(self, hidden)

    def expert_counts(self) -> list[int]:
        """Tokens routed to each expert so far."""
        if self.routed_tokens is None:
            return [0] * self.num_experts
        return self.routed_tokens.tolist()

    def not_held(self, name: str) -> list[str]:
        """Checkpoint name prefixes of the experts this rank does not hold (under `name`, this
        layer's module path)."""
        return [f"{name}.experts.{index}." for index, expert in enumerate(self.experts)
                if isinstance(expert, AbsentExpert)]

    def rebalance(self) -> bool:
        """EPLB: re-place the experts' copies over the ranks for the load since the last
        rebalance (every rank calls this at the same step); False where nothing moved."""
        if self.ep is None:
            return False
        return self.ep.rebalance(self.experts, self._counters())

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (float32): softmax over
        the router's logits, the k largest (ties: the lower expert, as the fused layer; bf16
        logits tie often, and torch's topk breaks ties in no set order), renormalised to sum to
        1 where the family does."""
        logits = F.linear(hidden, self.gate.weight, self.gate.bias)
        probabilities = logits.float().softmax(dim=-1)
        weights, experts = probabilities.sort(dim=-1, descending=True, stable=True)
        weights, experts = weights[:, :self.top_k], experts[:, :self.top_k]
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def run(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, H] (`LayerOps.moe` calls this): the fused C++ layer where
        the op set has one, else the Python loop; all-reduced under tensor parallelism."""
        fused = self.fused(ops.kernels)
        out = fused.forward(hidden) if fused is not None else self.run_loop(ops, hidden)
        if self.tp is not None:
            ops.all_reduce_(out, self.tp)
        return out

    def fused(self, kernels):
        """This layer as the op set's C++ MoeLayer (built on first use, after the weights are
        loaded), or None where it cannot run: kernels without it (the torch reference), an
        expert projection with no C++ kernel (its `stack_linear` is None), or the switch
        `KVSERVE_FUSED_MOE=0` (read when the layer is first run). `KVSERVE_GROUPED_MOE=0`
        keeps the fused layer but runs each expert's projections as their own calls rather
        than every active expert's in one parallel region (the same bits either way)."""
        if self._fused is None or self._fused[0] is not kernels:
            self._fused = (kernels, self._build_fused(kernels))
        return self._fused[1]

    def reset_fused(self) -> None:
        """Forget the fused layer (a projection's row limit changed): built again when next
        run."""
        self._fused = None

    def _build_fused(self, kernels):
        if os.environ.get("KVSERVE_FUSED_MOE", "1") == "0" or not hasattr(kernels, "MoeLayer"):
            return None
        if self.ep is not None:
            return None  # the C++ layer runs every expert
        experts = [self._stack_linears(expert, kernels) for expert in self.experts]
        shared = self._stack_linears(self.shared_expert, kernels) \
            if self.shared_expert is not None else (None, None)
        needed = experts + ([shared] if self.shared_expert is not None else [])
        if any(linear is None for pair in needed for linear in pair):
            return None
        self._counters()
        first = self.experts[0]
        return kernels.MoeLayer(
            self.gate.weight.float().contiguous(), self.top_k, self.normalize_top_k,
            first.hidden_act, [gate_up for gate_up, _ in experts],
            [down for _, down in experts], self.routed_tokens, *shared,
            None if self.shared_expert_gate is None else
            self.shared_expert_gate.weight.float().reshape(-1).contiguous(),
            None if self.gate.bias is None else self.gate.bias.float().contiguous(),
            first.swiglu_alpha, first.swiglu_limit,
            os.environ.get("KVSERVE_GROUPED_MOE", "1") != "0")

    @staticmethod
    def _stack_linears(expert: GatedMLP, kernels) -> tuple:
        """An expert's gate_up and down projections as C++ StackLinears (None: no kernel)."""
        return tuple(layer.method.stack_linear(layer, kernels)
                     for layer in (expert.gate_up_proj, expert.down_proj))

    def _counters(self) -> torch.Tensor:
        if self.routed_tokens is None:
            self.routed_tokens = torch.zeros(self.num_experts, dtype=torch.int64)
        return self.routed_tokens

    def run_loop(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, H] in Python over `ops`' projections, before any
        all-reduce."""
        weights, experts = self.route(hidden)
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        flat = experts.flatten()
        counted = torch.bincount(flat, minlength=self.num_experts)
        self._counters().add_(counted)
        if self.ep is not None:  # only the pairs this rank's copies compute
            flat = torch.where(self.ep.owned(experts).flatten(), flat, self.num_experts)
            counted = torch.bincount(flat, minlength=self.num_experts + 1)[:-1]
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = counted.tolist()
        tokens = order // self.top_k
        flat_weights = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                outputs = self.experts[expert](ops, hidden[rows])
                out.index_add_(0, rows, outputs.float() * flat_weights[start:start + count, None])
                start += count
        if self.shared_expert is not None:
            shared = self.shared_expert(ops, hidden).float()
            if self.shared_expert_gate is not None:
                shared *= torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight).float())
            out += shared
        return out.to(hidden.dtype)
