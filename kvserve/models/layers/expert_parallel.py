"""A mixture of experts split by expert over the tensor-parallel ranks (expert parallelism):
each rank holds whole experts (its placement's, expert_placement.py), attention stays tensor
parallel.

Every rank has every token after attention's all-reduce, and the router is replicated, so
dispatch needs no communication: each rank runs its own experts over the (token, expert) pairs
routed to copies it holds, and the layer's one all-reduce (the one tensor parallelism already
makes) sums the ranks' partial outputs: the all-gather / reduce-scatter of an all-to-all
dispatch, on one host, folded into that sum.

EPLB moves copies between ranks (`rebalance`): every rank computes the same new placement from
the same counters (each saw every routing), then the experts a rank gains arrive from a rank
that held them, point to point over the process group, every transfer in one global order (so
no two ranks wait on each other), and the experts it lost are dropped.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext
from kvserve.models.layers.expert_placement import ExpertPlacement, rebalanced


class AbsentExpert(nn.Module):
    """The place of an expert another rank holds: no weights, never run."""

    def forward(self, *args):
        raise RuntimeError("an expert this rank does not hold was run")


class ExpertParallel:
    def __init__(self, parallel: ParallelContext, num_experts: int, redundant: int = 0):
        self.parallel = parallel
        self.rank, self.ranks = parallel.tp_rank, parallel.tp_size
        self.redundant = redundant
        self.placement = ExpertPlacement.initial(num_experts, self.ranks, redundant)
        self.load_at_rebalance: torch.Tensor | None = None  # counters when last rebalanced
        self.rebalances = 0
        # the last rebalance's (before, after): mean / max of the ranks' loads over its window
        self.balancedness: tuple[float, float] | None = None
        self._owner_table: tuple | None = None  # (placement, holders, copies): `_owners`

    def holds(self, expert: int) -> bool:
        return expert in self.placement.experts_of(self.rank)

    def owned(self, experts: torch.Tensor) -> torch.Tensor:
        """Which (token, slot) pairs of the routed experts [T, k] this rank computes: the copy
        each pair goes to is the expert's (token index mod its copies)-th holder."""
        owners, counts = self._owners()
        tokens = torch.arange(experts.shape[0]).unsqueeze(1).expand_as(experts)
        copy_index = tokens % counts[experts]
        return owners[experts, copy_index] == self.rank

    def _owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The placement's holders per expert [E, ranks] (-1 past its copies) and its copies
        [E], made once a placement."""
        if self._owner_table is None or self._owner_table[0] is not self.placement:
            placement = self.placement
            owners = torch.full((placement.num_experts, self.ranks), -1, dtype=torch.int64)
            counts = torch.zeros(placement.num_experts, dtype=torch.int64)
            for expert in range(placement.num_experts):
                holders = placement.holders(expert)
                owners[expert, :len(holders)] = torch.tensor(holders)
                counts[expert] = len(holders)
            self._owner_table = (placement, owners, counts)
        return self._owner_table[1], self._owner_table[2]

    def rebalance(self, experts: nn.ModuleList, counters: torch.Tensor) -> bool:
        """Re-place the copies for the load since the last rebalance (`counters`: tokens routed
        to each expert so far); the module list then holds this rank's new experts. False (and
        nothing moved) where the placement stays."""
        load = counters.double() if self.load_at_rebalance is None \
            else (counters - self.load_at_rebalance).double()
        self.load_at_rebalance = counters.clone()
        new = rebalanced(load.tolist(), self.ranks, self.redundant)
        self.balancedness = (balancedness(self.placement, load.tolist()),
                             balancedness(new, load.tolist()))
        if new == self.placement or self.balancedness[1] <= self.balancedness[0]:
            self.balancedness = (self.balancedness[0], self.balancedness[0])
            return False
        template = next(m for m in experts if not isinstance(m, AbsentExpert))
        received = {}
        for expert, source, target in transfers(self.placement, new):
            if self.rank == source:
                _send(experts[expert], self._global(target), self.parallel.group)
            elif self.rank == target:
                received[expert] = _receive(template, self._global(source), self.parallel.group)
        mine = new.experts_of(self.rank)
        for expert in range(len(experts)):
            if expert in received:
                experts[expert] = received[expert]
            elif expert not in mine:
                experts[expert] = AbsentExpert()
        self.placement = new
        self.rebalances += 1
        return True

    def _global(self, tp_rank: int) -> int:
        return self.parallel.pp_rank * self.ranks + tp_rank


def balancedness(placement: ExpertPlacement, load: list[float]) -> float:
    """mean / max of the ranks' loads, each copy taking an equal share of its expert's (1.0:
    even)."""
    copies = [len(placement.holders(expert)) for expert in range(len(load))]
    ranks = [sum(load[e] / copies[e] for e in placement.experts_of(rank))
             for rank in range(placement.ranks)]
    return sum(ranks) / len(ranks) / max(ranks) if max(ranks) > 0 else 1.0


def transfers(old: ExpertPlacement, new: ExpertPlacement) -> list[tuple[int, int, int]]:
    """(expert, from rank, to rank) for every copy a rank gains, each from the lowest rank
    that held it, in one order every rank agrees on."""
    moves = []
    for rank in range(new.ranks):
        for expert in sorted(new.experts_of(rank) - old.experts_of(rank)):
            moves.append((expert, min(old.holders(expert)), rank))
    return moves


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """An expert's weights in an order both ends agree on (same structure: same names)."""
    named = dict(module.named_parameters())
    named.update(module.named_buffers())
    return [named[name] for name in sorted(named)]


def _send(module: nn.Module, target: int, group) -> None:
    for tensor in _tensors(module):
        dist.send(tensor.detach().contiguous().view(-1).view(torch.uint8), target, group=group)


def _receive(template: nn.Module, source: int, group) -> nn.Module:
    """A copy of the template expert (the same projections, kernels and row limits) with the
    source's weights received into it."""
    module = copy.deepcopy(template)
    for tensor in _tensors(module):
        raw = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
        dist.recv(raw, source, group=group)
        tensor.data.view(-1).view(torch.uint8).copy_(raw)
    return module
