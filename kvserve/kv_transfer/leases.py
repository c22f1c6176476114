"""Leases on the KV blocks one rank of a prefill engine serves to decode engines.

The engine core owns the blocks and keeps them while every rank holds a lease on them; each
rank's sender thread serves pulls of its shard. A lease is HELD from when the rank hears of it
(the step after the request finished) until a pull starts (PULLING), then DONE; a HELD lease
past its deadline expires. `take_releasable` reports DONE and expired leases once (the rank's
`finished_sending`), and the core frees the blocks when every rank has: blocks are never freed
while a pull reads them, and a lease that expired cannot be pulled (the decode side then
recomputes: vLLM's "served from freed blocks" bug avoided). Reported ids are remembered for a
while, so a second pull (or a second hold) of one is refused rather than served from blocks
that may belong to another request by then.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

FORGOTTEN_MEMORY = 65536  # reported ids remembered (a pull of one is refused at once)


class LeaseState(enum.Enum):
    HELD = "held"
    PULLING = "pulling"
    DONE = "done"


@dataclass
class Lease:
    block_ids: list[int]
    deadline: float
    state: LeaseState = LeaseState.HELD


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self._stalled: set[str] = set()  # pulls go unanswered (the `kv_send` test fault)
        self.num_expired = 0
        self.num_pulled = 0

    def hold(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        """A new lease; ignored for an id already held or reported (held once per request)."""
        with self._lock:
            if request_id not in self._leases and request_id not in self._forgotten:
                self._leases[request_id] = Lease(list(block_ids), self._clock() + timeout_s)

    def stall(self, request_id: str) -> None:
        """Test-only fault: never answer pulls of this lease, held now or later (it expires as
        if unpulled)."""
        with self._lock:
            self._stalled.add(request_id)

    def is_stalled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._stalled and request_id in self._leases

    def knows(self, request_id: str) -> bool:
        """Held now, or held and reported: a pull of any other id may come before its lease
        (the rank hears of it a step later than the decode engine may)."""
        with self._lock:
            return request_id in self._leases or request_id in self._forgotten

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
        """Request ids whose blocks this rank no longer reads (pulled, or expired unpulled);
        each reported once, then remembered as gone."""
        now = self._clock()
        with self._lock:
            ids = [rid for rid, lease in self._leases.items()
                   if lease.state is LeaseState.DONE
                   or (lease.state is LeaseState.HELD and now > lease.deadline)]
            for rid in ids:
                if self._leases.pop(rid).state is LeaseState.HELD:
                    self.num_expired += 1
                self._stalled.discard(rid)
                self._forgotten[rid] = None
            while len(self._forgotten) > FORGOTTEN_MEMORY:
                self._forgotten.popitem(last=False)
        return ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
