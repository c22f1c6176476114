"""Routing policies: rank the healthy replicas for one request, best first (the router tries
the first and, if it fails before answering, the second).

kv-aware is Dynamo's cost (lib/llm/src/kv_router/scheduler.rs): overlap_weight x the prompt
blocks the replica would have to compute (not cached there) + the blocks it already has in
use; the lowest cost wins, ties broken at random. A weight above 1 favours cache hits (TTFT),
below 1 spreading the load (ITL). least-loaded is the second term alone; round-robin takes
the replicas in turn.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    overlap_blocks: int  # leading prompt blocks the replica holds (0: unknown or stale)
    active_blocks: float  # KV blocks in use or about to be, by the router's count


def kv_aware_cost(candidate: Candidate, prompt_blocks: int, overlap_weight: float) -> float:
    uncached = max(0, prompt_blocks - candidate.overlap_blocks)
    return overlap_weight * uncached + candidate.active_blocks


class KVAwarePolicy:
    name = "kv-aware"
    uses_overlap = True

    def __init__(self, overlap_weight: float = 1.0, rng: random.Random | None = None):
        self.overlap_weight = overlap_weight
        self.rng = rng or random.Random()

    def rank(self, candidates: list[Candidate], prompt_blocks: int) -> list[Candidate]:
        keyed = [(kv_aware_cost(c, prompt_blocks, self.overlap_weight), self.rng.random(), c)
                 for c in candidates]
        return [c for _, _, c in sorted(keyed, key=lambda item: item[:2])]


class LeastLoadedPolicy:
    name = "least-loaded"
    uses_overlap = False

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def rank(self, candidates: list[Candidate], prompt_blocks: int) -> list[Candidate]:
        keyed = [(c.active_blocks, self.rng.random(), c) for c in candidates]
        return [c for _, _, c in sorted(keyed, key=lambda item: item[:2])]


class RoundRobinPolicy:
    name = "round-robin"
    uses_overlap = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, candidates: list[Candidate], prompt_blocks: int) -> list[Candidate]:
        """Candidates come in a fixed order (the --replica order, healthy ones only)."""
        if not candidates:
            return []
        start = next(self._turn) % len(candidates)
        return candidates[start:] + candidates[:start]


POLICIES = ("kv-aware", "round-robin", "least-loaded")


def make_policy(name: str, overlap_weight: float = 1.0, seed: int | None = None):
    rng = random.Random(seed)
    if name == "kv-aware":
        return KVAwarePolicy(overlap_weight, rng)
    if name == "least-loaded":
        return LeastLoadedPolicy(rng)
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
