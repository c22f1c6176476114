"""The collectives a tensor-parallel model needs, behind one small interface.

Two per decoder layer (after o_proj and down_proj, in place), one after the vocab-parallel
embedding, and one gather of the sampled rows' logits per step. `TorchCommunicator` runs them on
the process group (gloo on CPU, NCCL on CUDA); `SharedMemoryCommunicator`
(shm_all_reduce.py) on one host through shared memory, measured faster on CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: parallel_state builds the communicators
    from kvserve.distributed.parallel_state import ParallelContext


class Communicator(Protocol):
    name: str

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks in place; every rank ends with the same bits."""
        ...

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank order concatenation along the last dim (every rank passes the same shape)."""
        ...

    def close(self) -> None: ...


class TorchCommunicator:
    """The process group's own collectives (gloo: one TCP round trip per call even on one
    host; NCCL on GPUs)."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world_size = dist.get_world_size(group)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        if tensor.is_contiguous():
            dist.all_reduce(tensor, group=self.group)
            return
        dense = tensor.contiguous()  # gloo reduces a strided view's storage, not its elements
        dist.all_reduce(dense, group=self.group)
        tensor.copy_(dense)

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor, group=self.group)
        return torch.cat(pieces, dim=-1)

    def close(self) -> None:
        pass


def all_reduce(tensor: torch.Tensor, parallel: ParallelContext | None) -> torch.Tensor:
    """Sum over the tensor-parallel group in place (nothing for one rank); returns `tensor`."""
    if parallel is not None and parallel.tp_size > 1:
        parallel.communicator.all_reduce_(tensor)
    return tensor


def gather_vocab(logits_shard: torch.Tensor, parallel: ParallelContext | None) -> torch.Tensor:
    """[rows, vocab_shard] from each rank -> [rows, tp_size * vocab_shard] in rank order. Pass
    only the rows that sample: this is the step's largest message."""
    if parallel is None or parallel.tp_size == 1:
        return logits_shard
    return parallel.communicator.all_gather_last_dim(logits_shard)


def all_reduce_max(tensor: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Elementwise max over the group in place, through the process group (load time only: the
    row-parallel int8 scales, so each rank's slice is quantized as the whole row is)."""
    if parallel.tp_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=parallel.group)
    return tensor


def send_to_next_stage(packed: torch.Tensor, parallel: ParallelContext) -> None:
    """A pipeline stage's output (contiguous) to the same tensor rank of the next stage."""
    dist.send(packed, dst=parallel.next_stage_rank)


def recv_from_prev_stage(packed: torch.Tensor, parallel: ParallelContext) -> None:
    """Fill `packed` (its shape and dtype known from the step) from the previous stage."""
    dist.recv(packed, src=parallel.prev_stage_rank)


def world_barrier() -> None:
    """Wait for every rank of every stage (load time: one rank writing the weight cache)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def barrier(parallel: ParallelContext | None) -> None:
    """Wait for every rank (load time: rank 0 writing the weight cache the others then read)."""
    if parallel is not None and parallel.tp_size > 1:
        dist.barrier(group=parallel.group)
