"""The executor interface the engine core drives: load the model, size and hold the KV cache,
run scheduler outputs, report health, shut down.

`execute` runs one step and returns its samples. Executors whose workers form a pipeline
(pipeline parallelism) also take steps without waiting: `submit` hands a step over, `collect`
returns the samples of the oldest step not yet collected that had something scheduled, and
`max_concurrent_batches` says how many such steps may be in flight at once (1: `execute` only).

With a KV connector, each rank reports the transfers it finished after the steps it runs
(only when there are some); `take_kv_reports` hands them to the core, which counts a transfer
done once every rank reported it. Steps without reports cost nothing more.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

import torch

from kvserve.config import ModelConfig
from kvserve.protocol.worker import (
    ExecuteStep,
    KVCacheReady,
    KVConnectorOutput,
    ModelRunnerOutput,
)


class Executor(ABC):
    model_config: ModelConfig
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # K/V storage
    quantization: str
    kv_page_bytes: int  # one token's bytes in one layer's KV page (the layers' declared layout)
    max_concurrent_batches: int = 1

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, block_size: int,
                            placement: tuple[list[int], list[int]] | None = None,
                            ) -> list[KVCacheReady]:
        """Allocate `num_blocks` blocks of KV on every worker; called once, before execute.
        `placement`: the hybrid layout's (group, tensor) of each layer (None: one group).
        Every rank's answer, rank order (with what its KV connector tells the core)."""

    @abstractmethod
    def execute(self, step: ExecuteStep) -> ModelRunnerOutput:
        """Run one step's batch; the sampled token (and logprobs) of each sampling request."""

    def submit(self, step: ExecuteStep) -> None:
        """Hand a step over without waiting for it (here: run it now, keep the result). A step
        with nothing scheduled (only finished ids for the workers) gives nothing to collect."""
        if not hasattr(self, "_results"):
            self._results: deque[ModelRunnerOutput] = deque()
        output = self.execute(step)
        if step.scheduled:
            self._results.append(output)

    def collect(self) -> ModelRunnerOutput:
        """The samples of the oldest submitted step with something scheduled."""
        return self._results.popleft()

    def take_kv_reports(self, wait_s: float = 0.0, poll: bool = False
                        ) -> list[KVConnectorOutput]:
        """The KV connector reports workers sent since the last call, any rank's, oldest
        first. `poll`: ask them now (workers report after a step: an empty one will do).
        `wait_s`: when none has come, wait up to that long for one."""
        return []

    def check_health(self) -> None:
        """Raise if a worker is gone (the uni executor has none to lose)."""

    def shutdown(self) -> None:
        """Stop the workers and free what they hold."""


class PipelinedExecutor(Executor):
    """An executor whose workers take steps without being waited on (mp, ray): `execute` is
    `submit` then `collect`; subclasses implement those two."""

    @abstractmethod
    def submit(self, step: ExecuteStep) -> None: ...

    @abstractmethod
    def collect(self) -> ModelRunnerOutput: ...

    def execute(self, step: ExecuteStep) -> ModelRunnerOutput:
        self.submit(step)
        if not step.scheduled:
            return ModelRunnerOutput.empty()
        return self.collect()
