"""Where a mixture's experts live under expert parallelism (vLLM's `--enable-expert-parallel`,
`--enable-eplb`): each of R ranks has S slots, R x S physical experts in all; the E logical
experts fill them, E + `redundant` = R x S, the redundant slots holding second (third...) copies
of busy experts. A rank never holds two copies of one expert (a copy there would take no load
the first does not), so a rank's experts are a set, and its module list keeps them at their
logical index.

A token routed to an expert with several copies goes to one of them by its position in the
batch (copy `token % copies`): every rank routes every token (the router is replicated), so
every rank picks the same copy without talking. Any copy computes the same numbers, so the
placement never changes an output, only which rank does the work.

EPLB's placement (`rebalanced`): from the tokens each expert took over a window, copies go
one at a time to the expert with the most load per copy, then the copies, heaviest first, each
to the least-loaded rank with a free slot that does not hold that expert yet (the greedy
balanced packing of DeepSeek's EPLB, without its node level: one host), then swaps between the
busiest and idlest ranks while one helps. A rebalance that would not be more even than the
placement it replaces moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ExpertPlacement:
    """physical slot -> logical expert; rank r's slots are [r S, (r + 1) S)."""

    physical: tuple[int, ...]
    ranks: int

    @property
    def slots(self) -> int:
        return len(self.physical) // self.ranks

    @property
    def num_experts(self) -> int:
        return len(set(self.physical))

    def experts_of(self, rank: int) -> frozenset[int]:
        return frozenset(self.physical[rank * self.slots:(rank + 1) * self.slots])

    def holders(self, expert: int) -> list[int]:
        """The ranks that hold a copy of `expert`, in slot order."""
        return [slot // self.slots for slot, logical in enumerate(self.physical)
                if logical == expert]

    @classmethod
    def initial(cls, num_experts: int, ranks: int, redundant: int = 0) -> "ExpertPlacement":
        """Experts in contiguous runs of ranks (rank r: experts [r E/R, (r + 1) E/R) without
        redundancy); the redundant slots copy experts 0, 1, ... onto ranks that lack them, as
        a start before any load is measured."""
        check_divides(num_experts, ranks, redundant)
        return rebalanced([1.0] * num_experts, ranks, redundant, spread=True)


def check_divides(num_experts: int, ranks: int, redundant: int) -> None:
    """A clear error where the expert-parallel size cannot hold the experts."""
    if redundant < 0 or redundant > num_experts * (ranks - 1):
        raise UnsupportedArchitectureError(
            f"{redundant} redundant experts for {num_experts} experts over {ranks} "
            "expert-parallel ranks: a rank holds at most one copy of an expert")
    if (num_experts + redundant) % ranks:
        extra = f" plus {redundant} redundant" if redundant else ""
        raise UnsupportedArchitectureError(
            f"the expert-parallel size {ranks} does not divide the model's {num_experts} "
            f"experts{extra}: every rank needs the same number of experts (choose a "
            "tensor-parallel size, or a number of redundant experts, that makes it so)")


def rebalanced(load: list[float], ranks: int, redundant: int,
               spread: bool = False) -> ExpertPlacement:
    """A placement for the measured `load` (tokens per logical expert). `spread`: the initial
    one (equal loads): experts in contiguous runs per rank."""
    experts = len(load)
    check_divides(experts, ranks, redundant)
    slots = (experts + redundant) // ranks
    copies = [1] * experts
    for _ in range(redundant):
        candidates = [e for e in range(experts) if copies[e] < ranks]
        busiest = max(candidates, key=lambda e: (load[e] / copies[e], -e))
        copies[busiest] += 1
    if spread:
        order = [e for e in range(experts)] + [e for e in range(experts)
                                               for _ in range(copies[e] - 1)]
    else:
        order = sorted((e for e in range(experts) for _ in range(copies[e])),
                       key=lambda e: (-load[e] / copies[e], e))
    held: list[list[int]] = [[] for _ in range(ranks)]
    weight = [0.0] * ranks
    for expert in order:
        free = [r for r in range(ranks) if len(held[r]) < slots and expert not in held[r]]
        if not free:
            raise RuntimeError(f"no rank has a free slot for another copy of expert {expert}")
        rank = free[0] if spread else min(free, key=lambda r: (weight[r], r))
        held[rank].append(expert)
        weight[rank] += load[expert] / copies[expert]
    if not spread:
        _swap_down(held, [load[e] / copies[e] for e in range(experts)])
    physical = tuple(e for rank in range(ranks) for e in sorted(held[rank]))
    return ExpertPlacement(physical, ranks)


def _swap_down(held: list[list[int]], share: list[float], rounds: int = 64) -> None:
    """Refine a packing: while swapping a copy on the busiest rank with one on the idlest (an
    expert neither already holds) lowers the busier of the two, make the best such swap."""
    for _ in range(rounds):
        loads = [sum(share[e] for e in rank) for rank in held]
        busy = max(range(len(held)), key=lambda r: (loads[r], -r))
        idle = min(range(len(held)), key=lambda r: (loads[r], r))
        best, gain = None, 1e-12
        for a in held[busy]:
            for b in held[idle]:
                if a in held[idle] or b in held[busy]:
                    continue
                delta = share[a] - share[b]
                improved = loads[busy] - max(loads[busy] - delta, loads[idle] + delta)
                if improved > gain:
                    best, gain = (a, b), improved
        if best is None:
            return
        a, b = best
        held[busy][held[busy].index(a)] = b
        held[idle][held[idle].index(b)] = a
