"""The `uni` executor: one worker, the model and its KV cache, in the engine core's own process.
Steps reach it as the same ExecuteStep objects the other executors send, only not serialized."""

from __future__ import annotations

from kvserve.engine_config import EngineConfig
from kvserve.executor.base import Executor
from kvserve.protocol.worker import (
    ExecuteStep,
    InitKVCache,
    KVCacheReady,
    KVConnectorOutput,
    KVReport,
    ModelRunnerOutput,
)
from kvserve.worker.model_loading import kv_page_bytes
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
        self.kv_page_bytes = kv_page_bytes(loaded.model, loaded.kv_dtype)
        self._kv_reports: list[KVConnectorOutput] = []

    def initialize_kv_cache(self, num_blocks: int, block_size: int,
                            placement: tuple[list[int], list[int]] | None = None,
                            ) -> list[KVCacheReady]:
        return [self.worker.init_kv_cache(InitKVCache(num_blocks, block_size, *(placement or ([], []))))]

    def execute(self, step: ExecuteStep) -> ModelRunnerOutput:
        try:
            result = self.worker.execute(step)
        finally:
            self._keep(self.worker.take_kv_report())
        return result.output if result is not None else ModelRunnerOutput.empty()

    def take_kv_reports(self, wait_s: float = 0.0, poll: bool = False
                        ) -> list[KVConnectorOutput]:
        """The worker is here: its connector is asked directly (`poll` needs no step)."""
        if not self._kv_reports:
            self._keep(self.worker.poll_kv(wait_s))
        reports, self._kv_reports = self._kv_reports, []
        return reports

    def _keep(self, report: KVReport | None) -> None:
        if report is not None:
            self._kv_reports.append(report.output)

    @property
    def runner(self):
        """The worker's model runner (tests and profiling look inside it)."""
        return self.worker.runner
