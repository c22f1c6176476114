"""The executor interface the engine core drives: load the model, size and hold the KV cache,
run one scheduler output, report health, shut down."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.config import ModelConfig
from kvserve.core.model_runner import ModelRunnerOutput
from kvserve.core.scheduler import SchedulerOutput


class Executor(ABC):
    model_config: ModelConfig
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # K/V storage
    quantization: str

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate `num_blocks` blocks of KV on every worker; called once, before execute."""

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's batch; the sampled token (and logprobs) of each sampling request."""

    def check_health(self) -> None:
        """Raise if a worker is gone (the uni executor has none to lose)."""

    def shutdown(self) -> None:
        """Stop the workers and free what they hold."""
