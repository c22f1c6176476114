"""The `uni` executor: one worker, the model and its KV cache, in the engine core's own process.
Steps reach it as the same ExecuteStep objects the other executors send, only not serialized."""

from __future__ import annotations

from kvserve.engine_config import EngineConfig
from kvserve.executor.base import Executor
from kvserve.protocol.worker import ExecuteStep, InitKVCache, ModelRunnerOutput
from kvserve.worker.worker import Worker


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.worker = Worker(config, rank=0, world_size=1, init_method="")
        loaded = self.worker.loaded
        self.model = loaded.model
        self.model_config = loaded.config
        self.dtype = loaded.dtype
        self.kv_dtype = loaded.kv_dtype
        self.quantization = loaded.quantization

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.worker.init_kv_cache(InitKVCache(num_blocks, block_size))

    def execute(self, step: ExecuteStep) -> ModelRunnerOutput:
        result = self.worker.execute(step)
        return result.output if result is not None else ModelRunnerOutput.empty()

    @property
    def runner(self):
        """The worker's model runner (tests and profiling look inside it)."""
        return self.worker.runner
