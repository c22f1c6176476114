"""A worker: one rank's model shard (its pipeline stage's layers, its tensor-parallel slice of
them), its KV tensors and a ModelRunner, driven step by step by the engine core through an
executor. `Worker` is the rank itself, whatever holds it (the core's own process for `uni`, a
process for `mp`, a Ray actor for `ray`); `run_worker` is the process loop of the `mp` executor.

Started by the `mp` executor as `python -m kvserve.worker.worker IN OUT RANK WORLD INIT PARENT LOG`
with the EngineConfig as JSON on stdin. It joins the process group (torch.distributed, gloo on
CPU), loads its shard, reports ready, then runs each ExecuteStep it receives. Any exception is
fatal for the group (the other ranks would wait in a collective forever): it reports
WorkerFailed and exits, and the core fails with it. It also exits when the core goes away.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import torch
import zmq

from kvserve.engine_config import EngineConfig
from kvserve.platform import exit_when_parent_dies
from kvserve.plugins import load_plugins
from kvserve.protocol.worker import (
    ExecuteStep,
    FromWorker,
    InitKVCache,
    KVCacheReady,
    ScheduledData,
    StepResult,
    StopWorker,
    ToWorker,
    WorkerFailed,
    WorkerReady,
)
from kvserve.sample.logits_processor import ProcessorInit, load_processor_classes
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.request_state import CachedRequestState, RunnerInput, ScheduledItem

logger = logging.getLogger(__name__)


class Worker:
    """One rank. Every rank gets every ExecuteStep, in order; `execute` returns the step's
    samples on the output rank (last stage, tensor rank 0) and None elsewhere."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str):
        from kvserve.distributed.parallel_state import output_rank
        from kvserve.platform import configure_threads
        from kvserve.worker.model_loading import load_engine_model

        load_plugins()
        self.config = config
        # before the model loads: a processor that cannot be imported fails the start at once
        self.processor_classes = load_processor_classes(config.logits_processors)
        self.rank = rank
        self.is_output_rank = rank == output_rank(config.tensor_parallel_size,
                                                  config.pipeline_parallel_size)
        configure_threads(config.num_threads or max(1, (os.cpu_count() or 1) // world_size))
        self.parallel = None
        if world_size > 1:
            from kvserve.distributed.parallel_state import init_distributed

            self.parallel = init_distributed(
                rank, world_size, init_method, device=config.device,
                pipeline_parallel_size=config.pipeline_parallel_size)
        self.loaded = load_engine_model(config, self.parallel)
        self.requests: dict[str, CachedRequestState] = {}
        self.runner = None

    def ready_message(self) -> WorkerReady:
        loaded = self.loaded
        return WorkerReady(self.rank, loaded.config, str(loaded.dtype).removeprefix("torch."),
                           str(loaded.kv_dtype).removeprefix("torch."), loaded.quantization)

    def init_kv_cache(self, message: InitKVCache) -> KVCacheReady:
        self.runner = ModelRunner(self.loaded.model, message.num_blocks, message.block_size,
                                  self.config.device, self.config.seed,
                                  kv_dtype=self.loaded.kv_dtype, parallel=self.parallel,
                                  samples=self.is_output_rank,
                                  logits_processors=self._logits_processors())
        return KVCacheReady(self.rank)

    def _logits_processors(self) -> list:
        """The custom logits processors, built once, on the rank that samples."""
        if not self.is_output_rank:
            return []
        init = ProcessorInit(self.loaded.config.vocab_size, self.config.max_num_seqs,
                             torch.device(self.config.device))
        return [cls(init) for cls in self.processor_classes]

    def execute(self, step: ExecuteStep) -> StepResult | None:
        for new in step.new_requests:  # a request sent again (a re-run alone) keeps its state
            if new.request_id not in self.requests:
                self.requests[new.request_id] = CachedRequestState.from_new(new)
        scheduled = [self._scheduled(item) for item in step.scheduled]
        output = self.runner.execute(RunnerInput(scheduled, step.finished_ids))
        for request_id in step.finished_ids:
            self.requests.pop(request_id, None)
        if not self.is_output_rank or not step.scheduled:  # the core waits for nothing else
            return None
        for request_id, tokens in output.sampled_token_ids.items():
            self.requests[request_id].output_token_ids.extend(tokens)
        return StepResult(output)

    def _scheduled(self, item: ScheduledData) -> ScheduledItem:
        request = self.requests[item.request_id]
        if item.reset_blocks:
            request.block_ids = list(item.new_block_ids)
        else:
            request.block_ids.extend(item.new_block_ids)
        return ScheduledItem(request, item.token_ids, item.start_position, item.sample)

    def shutdown(self) -> None:
        if self.parallel is not None:
            from kvserve.distributed.parallel_state import destroy_distributed

            destroy_distributed(self.parallel)


def run_worker(config: EngineConfig, input_address: str, output_address: str, rank: int,
               world_size: int, init_method: str) -> None:
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    worker = None
    try:
        worker = Worker(config, rank, world_size, init_method)
        outputs.send(encoder.encode(worker.ready_message()))
        while True:
            message = decoder.decode(inputs.recv(copy=False).buffer)
            if isinstance(message, StopWorker):
                break
            if isinstance(message, InitKVCache):
                reply = worker.init_kv_cache(message)
            else:
                reply = worker.execute(message)
            if reply is not None:
                outputs.send(encoder.encode(reply), copy=False)
    except BaseException as exc:  # reported, then fatal: see the module docstring
        logger.exception("worker %d failed", rank)
        outputs.send(encoder.encode(WorkerFailed(rank, f"{type(exc).__name__}: {exc}")))
        outputs.close()
        context.term()
        os._exit(1)  # skip torch.distributed teardown: the other ranks may be mid-collective
    if worker is not None:
        worker.shutdown()
    outputs.close()
    inputs.close(linger=0)
    context.term()


def main(argv: list[str]) -> None:
    input_address, output_address, rank, world_size, init_method, parent, log_level = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_parent_dies(int(parent))
    logging.basicConfig(level=int(log_level),
                        format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: "
                               f"%(message)s")
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_worker(config, input_address, output_address, int(rank), int(world_size), init_method)


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["FromWorker", "Worker", "run_worker"]
