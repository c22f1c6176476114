"""Tensor parallelism: process groups, the collectives a sharded model calls, which slice of
each weight a rank holds. A worker joins with `init_distributed` and passes the returned
ParallelContext to `load_model(..., parallel=...)` / `random_model(..., parallel=...)`."""

from kvserve.distributed.communication import all_reduce, gather_vocab
from kvserve.distributed.parallel_state import (
    ALL_REDUCE_ENV,
    ParallelContext,
    destroy_distributed,
    init_distributed,
)
from kvserve.distributed.sharding import shard_config, validate_tensor_parallel

__all__ = ["ALL_REDUCE_ENV", "ParallelContext", "all_reduce", "destroy_distributed",
           "gather_vocab", "init_distributed", "shard_config", "validate_tensor_parallel"]
