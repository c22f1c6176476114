"""Leases on the KV blocks a prefill engine holds for decode engines.

The engine core's thread owns the blocks; the transport's thread serves pulls. A lease is
HELD from the request's finish until a pull starts (PULLING), then DONE; a HELD lease past its
deadline expires. The core's thread frees the blocks of DONE and expired leases
(`take_releasable`), so a decode engine that never comes leaks nothing, and blocks are never
freed while a pull reads them (a lease that expired cannot be pulled: the decode side then
recomputes, vLLM's known "served from freed blocks" bug avoided).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable


class LeaseState(enum.Enum):
    HELD = "held"
    PULLING = "pulling"
    DONE = "done"


@dataclass
class Lease:
    block_ids: list[int]
    deadline: float
    state: LeaseState = LeaseState.HELD
    stalled: bool = False  # pulls go unanswered (a sender hung; the `kv_send` test fault)


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_pulled = 0

    def hold(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        with self._lock:
            self._leases[request_id] = Lease(list(block_ids), self._clock() + timeout_s)

    def stall(self, request_id: str) -> None:
        """Test-only fault: never answer pulls of this lease (it expires as if unpulled)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.stalled = True

    def is_stalled(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is not None and lease.stalled

    def begin_pull(self, request_id: str) -> list[int] | None:
        """The blocks to send, now PULLING; None when unknown, expired or already pulled."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state is not LeaseState.HELD:
                return None
            if self._clock() > lease.deadline:
                return None
            lease.state = LeaseState.PULLING
            return list(lease.block_ids)

    def end_pull(self, request_id: str) -> None:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.state = LeaseState.DONE
                self.num_pulled += 1

    def take_releasable(self) -> list[str]:
        """Request ids whose blocks may be freed now (pulled, or expired unpulled); forgotten."""
        now = self._clock()
        with self._lock:
            ids = [rid for rid, lease in self._leases.items()
                   if lease.state is LeaseState.DONE
                   or (lease.state is LeaseState.HELD and now > lease.deadline)]
            for rid in ids:
                if self._leases.pop(rid).state is LeaseState.HELD:
                    self.num_expired += 1
        return ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
