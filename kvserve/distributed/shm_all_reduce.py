"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one host.

gloo sends every all-reduce through TCP loopback even on one machine: a few system calls and
wake-ups per call, several times per decoder layer. Here each rank copies its tensor into its
own slot of one memory-mapped /dev/shm file, publishes a sequence number, waits until every rank
has published the same number (spinning briefly, then yielding the core: ranks may outnumber
cores), and sums all slots itself, in rank order, so every rank gets the same bits. Two sets of
slots alternate between calls: a rank writing call k+1 cannot overwrite a slot another rank is
still reading for call k, because it passed call k's barrier only after every rank finished
call k-1. One barrier per call, no locks. Messages larger than a slot go in rounds.

The flags are plain 8-byte stores and loads: on x86-64 (TSO) a store is never seen before the
stores that precede it, so a peer that sees the number also sees the data. Other architectures
would need fences; `shm_supported()` keeps them on gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
# Bytes per rank per round: 4 MiB holds a 1,800-token prefill of a 576-wide fp32 hidden state or
# 64 rows of a 16K-wide fp32 logits shard; larger messages take several rounds.
DEFAULT_SLOT_BYTES = 4 << 20
# Polls of a peer's flag before yielding the core (~0.1 us each): on 2 cores shared by 3 ranks,
# a spinning rank holds the core the late rank needs.
SPINS_BEFORE_YIELD = 200
FLAG_STRIDE = 8  # int64s between two ranks' flags: one cache line each, no false sharing
_ALIGN = 64


def shm_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


class SharedMemoryCommunicator:
    name = "shm"

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 120.0):
        self.rank, self.world_size = rank, world_size
        self.slot_bytes = slot_bytes - slot_bytes % _ALIGN
        self.timeout_s = timeout_s
        header = world_size * FLAG_STRIDE * 8
        header += -header % _ALIGN
        size = header + 2 * world_size * self.slot_bytes
        self._mmap = _map_shared_file(rank, group, size)
        self._flags = np.frombuffer(self._mmap, dtype=np.int64, count=world_size * FLAG_STRIDE)
        self._slots = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=header,
                                       count=size - header).view(2, world_size, self.slot_bytes)
        self._flag_index = rank * FLAG_STRIDE
        self._peer_flags = [i * FLAG_STRIDE for i in range(world_size) if i != rank]
        self._seq = 0

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        per_round = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_round):
            chunk = flat[start:start + per_round]
            slots = self._exchange(chunk)
            torch.add(slots[0], slots[1], out=chunk)
            for peer in range(2, self.world_size):
                chunk.add_(slots[peer])
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor.reshape(-1, tensor.shape[-1])
        width = rows.shape[1]
        rows_per_round = max(1, self.slot_bytes // (width * rows.element_size()))
        if width * rows.element_size() > self.slot_bytes:
            raise ValueError(f"a row of {width} values does not fit a {self.slot_bytes}-byte slot")
        out = torch.empty(rows.shape[0], self.world_size, width, dtype=rows.dtype)
        for start in range(0, rows.shape[0], rows_per_round):
            block = rows[start:start + rows_per_round]
            slots = self._exchange(block.reshape(-1))
            out[start:start + block.shape[0]] = slots.view(self.world_size, block.shape[0],
                                                           width).transpose(0, 1)
        return out.view(*tensor.shape[:-1], self.world_size * width)

    def _exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Publish `flat` in this rank's slot and return every rank's slot ([world, n]) once
        all have published."""
        self._seq += 1
        slots = self._slots[self._seq % 2, :, : flat.numel() * flat.element_size()]
        slots = slots.view(flat.dtype)
        slots[self.rank].copy_(flat)
        self._flags[self._flag_index] = self._seq
        self._wait_for_peers(self._seq)
        return slots

    def _wait_for_peers(self, seq: int) -> None:
        flags = self._flags
        spins, deadline = 0, None
        for index in self._peer_flags:
            while flags[index] < seq:
                spins += 1
                if spins < SPINS_BEFORE_YIELD:
                    continue
                os.sched_yield()
                if spins % 256 == 0:
                    deadline = deadline or time.monotonic() + self.timeout_s
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"tensor-parallel rank {index // FLAG_STRIDE} did not reach "
                            f"collective {seq} within {self.timeout_s:.0f} s (did it die?)")

    def close(self) -> None:
        self._slots = self._flags = None
        try:
            self._mmap.close()
        except BufferError:  # a tensor view is still alive somewhere; the OS unmaps at exit
            pass


def _map_shared_file(rank: int, group: dist.ProcessGroup, size: int) -> mmap.mmap:
    """Rank 0 creates a zeroed file in /dev/shm and tells the others its name; once every rank
    has mapped it, rank 0 unlinks it, so nothing is left behind however the processes end."""
    path = [str(SHM_DIR / f"kvserve-tp-{uuid.uuid4().hex}") if rank == 0 else None]
    created = False
    try:
        if rank == 0:
            fd = os.open(path[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            created = True
            os.ftruncate(fd, size)
            os.close(fd)
        dist.broadcast_object_list(path, group=group, group_src=0)
        fd = os.open(path[0], os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier(group=group)
    finally:
        if created:
            os.unlink(path[0])
    return mapping
