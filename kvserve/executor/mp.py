"""The `mp` executor: one worker process per tensor-parallel rank on this host.

The engine core keeps the scheduler and the KV manager; the workers hold the model shards and
the KV tensors. Each step the core sends every worker the same ExecuteStep over its own ZeroMQ
PUSH socket (new requests' prompt and parameters once; per scheduled request the token ids it
computes, the block ids added since it last ran, whether it samples) and waits for rank 0's
sampled tokens. A worker that dies or fails takes the executor down with a WorkerDiedError, a
BaseException: per-request isolation cannot help when a collective lost a member, so the core
ends and its front-end fails (or restarts) it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import weakref

import msgspec
import zmq

from kvserve.core.model_runner import ModelRunnerOutput
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine_config import EngineConfig
from kvserve.executor.base import Executor
from kvserve.executor.protocol import (
    ExecuteStep,
    FromWorker,
    InitKVCache,
    KVCacheReady,
    NewRequestData,
    ScheduledData,
    StepResult,
    StopWorker,
    WorkerFailed,
    WorkerReady,
)
from kvserve.models import resolve_dtype
from kvserve.processes import (
    close_sockets,
    describe_exit,
    start_module_process,
    stop_process,
)

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 200
STARTUP_TIMEOUT_SECONDS = 600.0


class WorkerDiedError(BaseException):
    """A worker process died or failed: the executor cannot go on (see the module docstring).
    A BaseException so that the core's per-request isolation does not swallow it."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        _check_model_splits(config)
        self.config = config
        self.world_size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="kvserve-workers-")
        self.context = zmq.Context()
        self.results = self.context.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        results_address = f"ipc://{self._dir}/results"
        self.results.bind(results_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromWorker)
        self.inputs: list[zmq.Socket] = []
        self.workers: list[subprocess.Popen] = []
        self._sent_blocks: dict[str, list[int]] = {}  # request id -> block ids workers hold
        self._closed = False
        # also when the executor is garbage-collected without shutdown(): workers never outlive
        # it (the list of sockets is filled as workers start)
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self.inputs,
                                           self.results, self.context, self._dir)
        init_method = f"file://{self._dir}/rendezvous"
        try:
            for rank in range(self.world_size):
                self._start_worker(rank, results_address, init_method)
            ready = self._gather(WorkerReady, STARTUP_TIMEOUT_SECONDS)
        except BaseException:
            self.shutdown()
            raise
        first = ready[0]
        self.model_config = first.model_config
        self.dtype = resolve_dtype(first.dtype)
        self.kv_dtype = resolve_dtype(first.kv_dtype)
        self.quantization = first.quantization
        logger.info("%d workers ready (tensor parallel %d)", self.world_size, self.world_size)

    def _start_worker(self, rank: int, results_address: str, init_method: str) -> None:
        address = f"ipc://{self._dir}/input-{rank}"
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        self.inputs.append(socket)
        args = [address, results_address, str(rank), str(self.world_size), init_method,
                str(os.getpid()), str(logging.getLogger().getEffectiveLevel())]
        self.workers.append(start_module_process("kvserve.executor.worker", args, self.config))

    # ---- the executor interface ------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._broadcast(InitKVCache(num_blocks, block_size))
        self._gather(KVCacheReady, STARTUP_TIMEOUT_SECONDS)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(self._step_message(scheduler_output))
        if not scheduler_output.scheduled:
            return ModelRunnerOutput({}, {})
        return self._receive(StepResult, timeout=None).output

    def check_health(self) -> None:
        for rank, worker in enumerate(self.workers):
            if worker.poll() is not None:
                raise WorkerDiedError(f"worker {rank} died ({describe_exit(worker.returncode)})")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    # ---- what crosses per step ---------------------------------------------------------------
    def _step_message(self, scheduler_output: SchedulerOutput) -> ExecuteStep:
        new_requests, scheduled = [], []
        for item in scheduler_output.scheduled:
            request = item.request
            sent = self._sent_blocks.get(request.request_id)
            if sent is None:
                new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                   request.sampling_params))
                sent = self._sent_blocks[request.request_id] = []
            blocks, reset = _block_delta(sent, item.block_ids)
            scheduled.append(ScheduledData(request.request_id, item.token_ids,
                                           item.start_position, blocks, item.sample, reset))
        for request_id in scheduler_output.finished_ids:
            self._sent_blocks.pop(request_id, None)
        return ExecuteStep(new_requests, scheduled, list(scheduler_output.finished_ids))

    def _broadcast(self, message) -> None:
        self.check_health()
        data = self.encoder.encode(message)
        for socket in self.inputs:
            socket.send(data, copy=False)

    def _receive(self, kind, timeout: float | None):
        """The next message from a worker, which must be a `kind`; raises WorkerDiedError when
        a worker fails or dies (checked every LIVENESS_POLL_MS while waiting)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.results.poll(LIVENESS_POLL_MS):
                message = self.decoder.decode(self.results.recv(copy=False).buffer)
                if isinstance(message, WorkerFailed):
                    raise WorkerDiedError(f"worker {message.rank} failed: {message.message}")
                if not isinstance(message, kind):
                    raise WorkerDiedError(f"a worker sent {type(message).__name__}, "
                                          f"expected {kind.__name__}")
                return message
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"no {kind.__name__} from the workers in {timeout:.0f}s")

    def _gather(self, kind, timeout: float) -> list:
        """One `kind` message from every rank, in rank order."""
        messages = [self._receive(kind, timeout) for _ in range(self.world_size)]
        return sorted(messages, key=lambda message: message.rank)


def _stop_workers(workers: list[subprocess.Popen], inputs: list[zmq.Socket],
                  results: zmq.Socket, context: zmq.Context, directory: str) -> None:
    """Ask every live worker to stop, make sure they do (terminate, kill), reap them, close the
    sockets and remove their directory."""
    stop = msgspec.msgpack.encode(StopWorker())
    for socket, worker in zip(inputs, workers):
        if worker.poll() is None:
            try:
                socket.send(stop, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for worker in workers:
        stop_process(worker)
    close_sockets(context, [*inputs, results])
    shutil.rmtree(directory, ignore_errors=True)


def _check_model_splits(config: EngineConfig) -> None:
    """A model that cannot split over the ranks is a ValueError here, before any worker starts
    (read from the model's config alone)."""
    from kvserve.distributed.sharding import validate_tensor_parallel
    from kvserve.model_source import resolve_model
    from kvserve.weights import load_config

    validate_tensor_parallel(load_config(resolve_model(config.model)),
                             config.tensor_parallel_size)


def _block_delta(sent: list[int], current: list[int]) -> tuple[list[int], bool]:
    """(block ids to send, whether they replace the workers' table). Tables only grow while a
    request runs; a preempted request comes back with a new table, sent whole."""
    if len(current) >= len(sent) and current[:len(sent)] == sent:
        added = current[len(sent):]
        sent.extend(added)
        return list(added), False
    sent[:] = current
    return list(current), True


__all__ = ["MultiprocExecutor", "WorkerDiedError"]
