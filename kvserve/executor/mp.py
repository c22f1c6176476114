"""The `mp` executor: one worker process per rank (tensor x pipeline) on this host.

The engine core keeps the scheduler and the KV manager; the workers hold the model shards and
the KV tensors. Each step the core sends every worker the same ExecuteStep over its own ZeroMQ
PUSH socket (new requests' prompt and parameters once; per scheduled request the token ids it
computes, the block ids added since it last ran, whether it samples) and reads the output
rank's sampled tokens (the last pipeline stage's tensor rank 0). With pipeline stages, up to
one step per stage is in flight (`submit` / `collect`). Any rank may also send a KV connector
report after a step (only when it has one); they are kept for `take_kv_reports`, whatever the
executor was waiting for when they came. A worker that dies or fails takes the executor down
with a WorkerDiedError, a BaseException: per-request isolation cannot help when a collective
lost a member, so the core ends and its front-end fails (or restarts) it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import weakref
from collections import deque

import msgspec
import zmq

from kvserve.engine_config import EngineConfig
from kvserve.executor.base import PipelinedExecutor
from kvserve.models import resolve_dtype, resolve_kv_dtype
from kvserve.processes import (
    close_sockets,
    describe_exit,
    start_module_process,
    stop_process,
)
from kvserve.protocol.worker import (
    ExecuteStep,
    FromWorker,
    InitKVCache,
    KVCacheReady,
    KVConnectorOutput,
    KVReport,
    ModelRunnerOutput,
    StepResult,
    StopWorker,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 200
STARTUP_TIMEOUT_SECONDS = 600.0


class WorkerDiedError(BaseException):
    """A worker process died or failed: the executor cannot go on (see the module docstring).
    A BaseException so that the core's per-request isolation does not swallow it."""


class MultiprocExecutor(PipelinedExecutor):
    def __init__(self, config: EngineConfig):
        _check_model_splits(config)
        self.config = config
        self.world_size = config.world_size
        self.max_concurrent_batches = config.pipeline_parallel_size
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
        self._pending = 0  # submitted steps with something scheduled, not yet collected
        self._step_results: deque[StepResult] = deque()  # came while looking for reports
        self._kv_reports: list[KVConnectorOutput] = []
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
        self.kv_dtype = resolve_kv_dtype(first.kv_dtype)
        self.quantization = first.quantization
        self.kv_page_bytes = max(worker.kv_page_bytes for worker in ready)
        logger.info("%d workers ready (tensor parallel %d, pipeline parallel %d)",
                    self.world_size, config.tensor_parallel_size,
                    config.pipeline_parallel_size)

    def _start_worker(self, rank: int, results_address: str, init_method: str) -> None:
        address = f"ipc://{self._dir}/input-{rank}"
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        self.inputs.append(socket)
        args = [address, results_address, str(rank), str(self.world_size), init_method,
                str(os.getpid()), str(logging.getLogger().getEffectiveLevel())]
        self.workers.append(start_module_process("kvserve.worker.worker", args, self.config))

    # ---- the executor interface ------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int, block_size: int,
                            placement: tuple[list[int], list[int]] | None = None,
                            ) -> list[KVCacheReady]:
        self._broadcast(InitKVCache(num_blocks, block_size, *(placement or ([], []))))
        return self._gather(KVCacheReady, STARTUP_TIMEOUT_SECONDS)

    def submit(self, step: ExecuteStep) -> None:
        """Every worker gets the step; the pipeline's first stage starts on it while later
        stages may still run earlier steps (workers run steps in the order sent)."""
        self._broadcast(step)
        if step.scheduled:
            self._pending += 1

    def collect(self) -> ModelRunnerOutput:
        """The output rank (last stage, tensor rank 0) answers steps in order, and only those
        with something scheduled."""
        if self._pending == 0:
            raise RuntimeError("collect() without a submitted step to collect")
        self._pending -= 1
        if self._step_results:
            return self._step_results.popleft().output
        return self._receive(StepResult, timeout=None).output

    def take_kv_reports(self, wait_s: float = 0.0, poll: bool = False
                        ) -> list[KVConnectorOutput]:
        if poll:
            self._broadcast(ExecuteStep([], [], []))
        self._drain(0)
        if not self._kv_reports and wait_s > 0:
            self._drain(wait_s)
        reports, self._kv_reports = self._kv_reports, []
        return reports

    def check_health(self) -> None:
        for rank, worker in enumerate(self.workers):
            if worker.poll() is not None:
                raise WorkerDiedError(f"worker {rank} died ({describe_exit(worker.returncode)})")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    # ---- messages -------------------------------------------------------------------------
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
                message = self._read()
                if message is None:
                    continue
                if not isinstance(message, kind):
                    raise WorkerDiedError(f"a worker sent {type(message).__name__}, "
                                          f"expected {kind.__name__}")
                return message
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"no {kind.__name__} from the workers in {timeout:.0f}s")

    def _read(self):
        """The next message (one is waiting); a KV report is kept and gives None."""
        message = self.decoder.decode(self.results.recv(copy=False).buffer)
        if isinstance(message, WorkerFailed):
            raise WorkerDiedError(f"worker {message.rank} failed: {message.message}")
        if isinstance(message, KVReport):
            self._kv_reports.append(message.output)
            return None
        return message

    def _drain(self, wait_s: float) -> None:
        """Read every message waiting (the first may take up to `wait_s` to come), keeping
        reports and step results for later."""
        timeout_ms = int(wait_s * 1000)
        while self.results.poll(timeout_ms):
            message = self._read()
            if isinstance(message, StepResult):
                self._step_results.append(message)
            elif message is not None:
                raise WorkerDiedError(f"a worker sent {type(message).__name__} between steps")
            timeout_ms = 0

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
    from kvserve.distributed.sharding import (
        validate_pipeline_parallel,
        validate_tensor_parallel,
    )
    from kvserve.model_source import resolve_model
    from kvserve.models import load_config

    model_config = load_config(resolve_model(config.model))
    validate_tensor_parallel(model_config, config.tensor_parallel_size)
    validate_pipeline_parallel(model_config, config.pipeline_parallel_size)


__all__ = ["MultiprocExecutor", "WorkerDiedError"]
