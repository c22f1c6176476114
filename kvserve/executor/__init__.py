"""Executors: where the model runs for the engine core. `uni` runs it in the core's own process;
`mp` runs one worker process per tensor-parallel rank on this host (`ray`, for several hosts,
comes next)."""

from kvserve.executor.base import Executor
from kvserve.executor.uni import UniExecutor


def make_executor(config) -> Executor:
    """The executor `config.executor_backend` names."""
    if config.executor_backend == "mp":
        from kvserve.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniExecutor(config)


__all__ = ["Executor", "UniExecutor", "make_executor"]
