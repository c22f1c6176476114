"""Executors: where the model runs for the engine core. `uni` runs it in the core's own process;
`mp` runs one worker process per rank on this host; `ray` runs the same workers as Ray actors,
on one host or several."""

from kvserve.executor.base import Executor
from kvserve.executor.uni import UniExecutor


def make_executor(config) -> Executor:
    """The executor `config.executor_backend` names."""
    if config.executor_backend == "mp":
        from kvserve.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    if config.executor_backend == "ray":
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    return UniExecutor(config)


__all__ = ["Executor", "UniExecutor", "make_executor"]
