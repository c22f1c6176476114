"""The persistent batch: which row of a step's logits each sampling request has.

A request keeps its row while it samples step after step, so the sampler's logits processors
keep their per-row state and hear only what changed (a BatchUpdate): requests that joined,
requests that left (finished, preempted, or not sampling this step), and rows moved to keep the
batch dense. The runner computes the logits in this row order.
"""

from __future__ import annotations

from kvserve.sample.logits_processor import (
    AddedRow,
    BatchUpdate,
    MoveDirection,
    MovedRow,
)
from kvserve.worker.request_state import CachedRequestState


class InputBatch:
    def __init__(self, emits_updates: bool = True):
        """`emits_updates`: False on ranks that never sample (they only need the row order,
        which every rank computes alike)."""
        self.requests: list[CachedRequestState] = []  # row -> request
        self.emits_updates = emits_updates
        self._unapplied = False  # the last update never reached the processors whole
        self._bound = 0  # rows the processors may hold state for

    def update(self, sampling: list[CachedRequestState]) -> BatchUpdate | None:
        """Make the batch this step's sampling requests: leavers' rows go to joiners (lowest
        first), and rows left empty are filled from the end. Returns the changes."""
        old_size = len(self.requests)
        staying = set(sampling)
        removed = [row for row, request in enumerate(self.requests) if request not in staying]
        present = set(self.requests)
        joining = [request for request in sampling if request not in present]
        free = list(reversed(removed))  # popped lowest first
        added = []
        for request in joining:
            row = free.pop() if free else len(self.requests)
            if row == len(self.requests):
                self.requests.append(request)
            else:
                self.requests[row] = request
            added.append(_added(row, request))
        moved = self._condense(sorted(free), len(sampling))
        if not self.emits_updates:
            return None
        if self._unapplied:  # the processors may hold any mix of old and new: start over
            return self._reset()
        self._bound = max(self._bound, old_size, len(self.requests))
        self._unapplied = True
        return BatchUpdate(len(self.requests), removed, added, moved)

    def applied(self) -> None:
        """The processors took the last update (the step's sampling went through)."""
        self._unapplied = False
        self._bound = len(self.requests)

    def _condense(self, holes: list[int], size: int) -> list[MovedRow]:
        """Fill the empty rows below `size` with the last rows, then drop the tail."""
        empty = set(holes)
        sources = [row for row in range(size, len(self.requests)) if row not in empty]
        moved = []
        for target, source in zip([hole for hole in holes if hole < size], reversed(sources)):
            self.requests[target] = self.requests[source]
            moved.append(MovedRow(source, target, MoveDirection.UNIDIRECTIONAL))
        del self.requests[size:]
        return moved

    def _reset(self) -> BatchUpdate:
        """Every row the processors may know of removed, every request added again."""
        removed = range(max(self._bound, len(self.requests)))
        self._bound = len(removed)
        return BatchUpdate(len(self.requests), removed,
                           [_added(row, request) for row, request in enumerate(self.requests)])


def _added(row: int, request: CachedRequestState) -> AddedRow:
    return AddedRow(row, request.sampling_params, request.prompt_token_ids,
                    request.output_token_ids)
