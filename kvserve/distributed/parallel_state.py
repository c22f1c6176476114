"""Who this process is among the ranks (tensor x pipeline), and how to join them.

Ranks are laid out stage by stage: global rank = pp_rank * tp_size + tp_rank, so a stage's
tensor-parallel group is a run of consecutive ranks and rank r hands its stage's output to rank
r + tp_size. A model built with a `ParallelContext` holds only its stage's layers and its rank's
slice of their weights and KV heads, and calls the context's communicator where slices meet
(kvserve/distributed/communication.py). One rank has no context at all (None): the
single-process path is today's, unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from kvserve.distributed.communication import Communicator

# Which all-reduce a CPU group uses: "shm" (shared memory, one host), "torch" (the process
# group's own: gloo on CPU, NCCL on CUDA) or "auto" (shm where it can run; measured faster,
# docs/performance-journal.md). The argument of init_distributed wins over this variable.
ALL_REDUCE_ENV = "KVSERVE_TP_ALL_REDUCE"
ALL_REDUCE_CHOICES = ("auto", "shm", "torch")


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place among the ranks. `group` is its stage's tensor-parallel process group
    (None only for a single rank); `communicator` runs that group's collectives. Stages talk
    point to point over the default (world) group."""

    tp_rank: int = 0
    tp_size: int = 1
    group: dist.ProcessGroup | None = field(default=None, compare=False)
    communicator: "Communicator | None" = field(default=None, compare=False)
    pp_rank: int = 0
    pp_size: int = 1
    # decoder layers per stage (set by the loader, which knows the quantization); None: the
    # default split of sharding.stage_layer_counts
    layer_partition: tuple[int, ...] | None = None
    # mixtures of experts split by expert over the tensor-parallel group, attention still by
    # heads (vLLM's --enable-expert-parallel), with this many extra copies of busy experts
    # (EPLB's redundant experts; models/layers/expert_parallel.py)
    expert_parallel: bool = False
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a group of size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside {self.pp_size} stages")

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int:
        """The rank this one receives hidden states from (same tensor rank, previous stage)."""
        return self.rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank that reports a step's samples: tensor rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def with_layer_partition(parallel: ParallelContext | None, config, quantization: str
                         ) -> ParallelContext | None:
    """The context with its stages' layer split for a model quantized as `quantization`."""
    if parallel is None or parallel.pp_size == 1:
        return parallel
    from kvserve.distributed.sharding import head_cost_for, stage_layer_counts

    counts = stage_layer_counts(config, parallel.pp_size, head_cost_for(quantization))
    return dataclasses.replace(parallel, layer_partition=tuple(counts))


def stage_of(parallel: ParallelContext | None) -> tuple[int, int]:
    """(pp_rank, pp_size); (0, 1) without a context."""
    return (0, 1) if parallel is None else (parallel.pp_rank, parallel.pp_size)


def is_distributed(parallel: ParallelContext | None) -> bool:
    """More than one rank holds the model (tensor or pipeline split)."""
    return parallel is not None and parallel.tp_size * parallel.pp_size > 1


def active(parallel: ParallelContext | None) -> ParallelContext | None:
    """The context when it spans more than one rank, else None: models keep None for tp_size 1
    so their hot loops test one attribute and call nothing."""
    return parallel if parallel is not None and parallel.tp_size > 1 else None


def default_backend(device: str | torch.device = "cpu") -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, backend: str | None = None,
                     all_reduce: str | None = None, device: str | torch.device = "cpu",
                     timeout_s: float = 120.0, pipeline_parallel_size: int = 1
                     ) -> ParallelContext:
    """Join the process group (every rank calls this with the same init_method, e.g.
    "tcp://127.0.0.1:29500" or "file:///tmp/kvserve-tp-rendezvous") and return this rank's
    context: `pipeline_parallel_size` stages of world_size / stages tensor-parallel ranks each.
    `all_reduce`: see ALL_REDUCE_ENV."""
    if world_size % pipeline_parallel_size:
        raise ValueError(f"{world_size} ranks do not make {pipeline_parallel_size} equal stages")
    backend = backend or default_backend(device)
    choice = all_reduce or os.environ.get(ALL_REDUCE_ENV, "auto")
    if choice not in ALL_REDUCE_CHOICES:
        raise ValueError(f"Unknown all-reduce {choice!r}; choose one of "
                         f"{', '.join(ALL_REDUCE_CHOICES)}")
    if backend == "nccl":  # one GPU per rank on this host
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    tp_size = world_size // pipeline_parallel_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    group = dist.group.WORLD
    if pipeline_parallel_size > 1:  # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
                  for stage in range(pipeline_parallel_size)]
        group = groups[pp_rank]
    context = build_context(tp_rank, tp_size, group, choice, backend)
    return dataclasses.replace(context, pp_rank=pp_rank, pp_size=pipeline_parallel_size)


def build_context(rank: int, world_size: int, group: dist.ProcessGroup, all_reduce: str,
                  backend: str) -> ParallelContext:
    """A context over an existing group with the chosen communicator (collective: every rank of
    the group must call it)."""
    from kvserve.distributed.communication import TorchCommunicator
    from kvserve.distributed.shm_all_reduce import (
        SharedMemoryCommunicator,
        shm_supported,
    )

    if world_size == 1:
        return ParallelContext(0, 1, group, None)
    use_shm = all_reduce != "torch" and backend == "gloo" and _one_host(group)
    if all_reduce == "shm" and not use_shm:
        raise ValueError("the shared-memory all-reduce needs gloo (CPU tensors) and every rank "
                         "on one host")
    use_shm = use_shm and shm_supported()
    communicator = (SharedMemoryCommunicator(rank, world_size, group) if use_shm
                    else TorchCommunicator(group))
    return ParallelContext(rank, world_size, group, communicator)


def _one_host(group: dist.ProcessGroup) -> bool:
    """Every rank on this machine: same host name and kernel boot id (containers may share a
    host name)."""
    from kvserve.platform import host_identity

    names: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, host_identity(), group=group)
    return len(set(names)) == 1


def destroy_distributed(parallel: ParallelContext | None) -> None:
    """Release the communicator's shared memory and leave the process group."""
    if parallel is not None and parallel.communicator is not None:
        parallel.communicator.close()
    if dist.is_initialized():
        dist.destroy_process_group()
