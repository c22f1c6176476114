"""How the front-end reaches the engine core: in this process, or in a process of its own.

Both clients speak the messages of protocol/engine_core.py: `add_request`, `abort_requests`,
`get_outputs` (one EngineCoreOutputs per core step), `call_utility`, `shutdown`. The process
client also watches the core: if it dies (segfault, kill -9, OOM kill) the next call raises
EngineDeadError within LIVENESS_POLL_SECONDS, so nobody waits on a dead core; a core that
says it is dying (CoreDying: a worker died) is treated as dead at once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq

from kvserve import errors
from kvserve.engine_config import EngineConfig
from kvserve.errors import EngineDeadError
from kvserve.processes import (
    close_sockets,
    describe_exit,
    start_module_process,
    stop_process,
)
from kvserve.protocol.engine_core import (
    AbortRequests,
    Codec,
    CoreDying,
    CoreFailed,
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    Shutdown,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

LIVENESS_POLL_SECONDS = 0.2
STARTUP_TIMEOUT_SECONDS = 600.0
# utilities whose results are structs (they cross as plain msgpack arrays)
_UTILITY_RESULTS = {"stats": SchedulerStats}


class InprocClient:
    """The core as an object, stepped by `get_outputs` on the caller's thread (the engine
    thread). `add_request` and `abort_requests` may come from any thread: on the stepping
    thread they apply at once (an offline abort frees its blocks right away); from another
    they are queued and applied at the start of the next `get_outputs`, so the core itself is
    only ever touched by one thread, as a process core is."""

    def __init__(self, config: EngineConfig, warm_up: bool = False):
        from kvserve.core.engine_core import EngineCore

        self.core = EngineCore(config)
        if warm_up:
            self.core.warm_up()
        self.ready = self.core.ready_info(os.getpid())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stepping_thread = threading.get_ident()  # until get_outputs runs elsewhere

    def add_request(self, request: EngineCoreRequest) -> None:
        self._command(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._command(AbortRequests(list(request_ids)))

    def _command(self, command) -> None:
        self._commands.put(command)
        if threading.get_ident() == self._stepping_thread:
            self._apply_commands(wait=None)  # in order, after any queued from elsewhere

    def wake(self) -> None:
        """End a `get_outputs` waiting while idle (shutdown)."""
        self._commands.put(None)

    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """One core step's outputs. While idle, waits up to `timeout` seconds for a request or
        an abort first (None or 0: does not wait), then reports the core's stats."""
        self._stepping_thread = threading.get_ident()
        self._apply_commands(wait=None)
        self.core.housekeeping()  # held KV blocks pulled or expired (the engine loop's 0.5 s)
        if not self.core.has_unfinished():
            if timeout:
                self._apply_commands(wait=min(timeout, self.core.idle_poll_seconds() or timeout))
            if not self.core.has_unfinished():
                return EngineCoreOutputs([], self.core.stats())
        try:
            return self.core.step()
        except Exception as exc:  # no request owns it: fail them all, keep the core
            logger.exception("engine step failed; failing the requests in flight")
            return self.core.fail_all("running this request", exc)

    def _apply_commands(self, wait: float | None) -> None:
        """Apply every queued add and abort, in order; with `wait`, block up to that long for
        the first."""
        try:
            command = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
            while True:
                if isinstance(command, EngineCoreRequest):
                    self.core.add_request(command)
                elif isinstance(command, AbortRequests):
                    self.core.abort_requests(command.request_ids)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in self.core.UTILITIES:
            raise ValueError(f"no utility {method!r}")
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient:
    """The core in a spawned process, over two ZeroMQ ipc sockets this side binds: PUSH for
    requests and aborts, PULL for outputs. One thread at a time may call `get_outputs` /
    `call_utility` (the reader); the senders may be called from another thread only under a
    lock the caller holds (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, config: EngineConfig, startup_timeout: float = STARTUP_TIMEOUT_SECONDS,
                 wait: bool = True):
        """`wait`: block until the core is ready; False returns once its process is started
        (the caller overlaps its own start-up work, then reads `ready`, which waits)."""
        self.codec = Codec()
        self._socket_dir = tempfile.mkdtemp(prefix="kvserve-core-")
        input_address = f"ipc://{self._socket_dir}/input"
        output_address = f"ipc://{self._socket_dir}/output"
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(input_address)
        self.output = self.context.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_address)
        self._closed = False
        self._dying: str | None = None  # the core said it is exiting (CoreDying), and why
        self._buffered: collections.deque[EngineCoreOutputs] = collections.deque()
        self._call_ids = itertools.count()
        self.process = _start_core_process(config, input_address, output_address)
        # the finalizer holds the sockets: closed by name, not found through the context's
        # weak set, which a garbage-collected cycle empties before finalizers run (then
        # Context.term() would wait for them forever)
        self._finalizer = weakref.finalize(self, _stop_process, self.process, self.context,
                                           [self.input, self.output], self._socket_dir)
        self._startup_timeout = startup_timeout
        self._ready: CoreReady | None = None
        if wait:
            self.wait_ready()

    @property
    def ready(self) -> CoreReady:
        return self.wait_ready()

    def wait_ready(self) -> CoreReady:
        """The core's CoreReady, waiting for it the first time (a core that fails to start
        is stopped and its error raised)."""
        if self._ready is None:
            try:
                self._ready = self._wait_ready(self._startup_timeout)
            except BaseException:
                self.shutdown()
                raise
            logger.info("engine core process %d ready (%.1fs to load)", self.process.pid,
                        self._ready.load_seconds)
        return self._ready

    # ---- start -------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> CoreReady:
        message = self._receive(timeout)
        if message is None:
            raise EngineDeadError(f"the engine core did not start within {timeout:.0f}s")
        if isinstance(message, CoreFailed):
            raise _startup_error(message.message)
        if not isinstance(message, CoreReady):
            raise EngineDeadError(f"the engine core sent {type(message).__name__} first")
        return message

    # ---- sending -----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def _send(self, message) -> None:
        self._check_alive()
        self.input.send(self.codec.encode(message), copy=False)

    # ---- receiving ---------------------------------------------------------------------
    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next step's outputs; None if `timeout` seconds pass without any."""
        if self._buffered:
            return self._buffered.popleft()
        while True:
            message = self._receive(timeout)
            if message is None or isinstance(message, EngineCoreOutputs):
                return message
            logger.warning("unexpected %s from the engine core", type(message).__name__)

    def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Call one of EngineCore.UTILITIES in the core; step outputs that arrive meanwhile are
        kept for get_outputs."""
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        deadline = time.monotonic() + timeout
        while True:
            message = self._receive(max(0.0, deadline - time.monotonic()))
            if message is None:
                raise EngineDeadError(f"the engine core did not answer {method!r}")
            if isinstance(message, EngineCoreOutputs):
                self._buffered.append(message)
            elif isinstance(message, UtilityResult) and message.call_id == call_id:
                if message.error is not None:
                    raise RuntimeError(f"{method} failed in the engine core: {message.error}")
                return msgspec.convert(message.result, _UTILITY_RESULTS.get(method, Any))

    def _receive(self, timeout: float | None):
        """One decoded message, or None after `timeout`; raises EngineDeadError as soon as the
        core process is gone and nothing it sent is left to read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = LIVENESS_POLL_SECONDS if deadline is None else \
                max(0.0, min(LIVENESS_POLL_SECONDS, deadline - time.monotonic()))
            if self.output.poll(int(wait * 1000)):
                message = self.codec.decode_output(self.output.recv(copy=False).buffer)
                if isinstance(message, CoreDying):
                    self._dying = message.message
                    self._check_alive()
                return message
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    # ---- lifecycle ---------------------------------------------------------------------
    def wake(self) -> None:
        """Nothing to do: a waiting `get_outputs` returns within LIVENESS_POLL_SECONDS."""

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine core was shut down")
        if self._dying is not None:
            raise EngineDeadError(f"the engine core failed: {self._dying}")
        if self.process.poll() is not None:
            raise EngineDeadError(f"the engine core process died "
                                  f"({describe_exit(self.process.returncode)})")

    def shutdown(self) -> None:
        """Ask the core to stop, then make sure: terminate, kill; reap it; close the sockets."""
        if self._closed:
            return
        if self.process.poll() is None:
            try:
                self.input.send(self.codec.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._closed = True
        self._finalizer()


def _start_core_process(config: EngineConfig, input_address: str,
                        output_address: str) -> subprocess.Popen:
    args = [input_address, output_address, str(os.getpid()),
            str(logging.getLogger().getEffectiveLevel())]
    return start_module_process("kvserve.core.core_process", args, config)


def _stop_process(process: subprocess.Popen, context: zmq.Context, sockets: list[zmq.Socket],
                  socket_dir: str) -> None:
    """Stop and reap the core process, close the sockets, remove their directory."""
    stop_process(process)
    close_sockets(context, sockets)
    shutil.rmtree(socket_dir, ignore_errors=True)


def _startup_error(message: str) -> Exception:
    """Re-raise the core's start-up failure as the same kvserve error type where it is one
    (a corrupt model file stays a CorruptModelFileError), else ValueError/EngineDeadError."""
    name, _, text = message.partition(": ")
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, errors.KVServeError):
        return kind(text)
    if name == "ValueError":
        return ValueError(text)
    return EngineDeadError(f"the engine core failed to start: {message}")


def make_core_client(config: EngineConfig, warm_up: bool = False, wait: bool = True):
    """The client `config.engine_core` asks for: `process` or `thread` (in this process).
    `wait` False: a process core is started and not waited for (`client.ready` waits)."""
    if config.engine_core == "process":
        return MPClient(config, wait=wait)
    return InprocClient(config, warm_up)
