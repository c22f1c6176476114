"""What a worker's step hands its speculative proposer (spec_decode/proposers.py): plain data,
shared by the model runner, which keeps the forward, and every proposer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardView:
    """The target's forward of a step, as the model runner ran it: its scheduled items (in
    row order), positions, attention metadata and final hidden states [tokens, hidden]."""

    scheduled: list
    positions: Any
    metadata: Any
    hidden: Any


@dataclass
class ProposalStep:
    """What a step leaves a proposer: every request the worker holds (CachedRequestState,
    its tokens including this step's samples), the tokens each sampling request took, the
    drafts each may get, and the forward (for proposers that read hidden states)."""

    requests: dict
    sampled: dict[str, list[int]]
    limits: dict[str, int]
    forward: ForwardView | None = None
