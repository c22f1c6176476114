"""AsyncEngine: the LLMEngine on a background thread, fed and drained from asyncio.

The engine thread owns the LLMEngine: it takes add/abort commands from a queue, steps while work
exists, and hands each RequestOutput to the request's asyncio queue. Callers `generate()` an async
stream; when the stream is closed early (a client went away) the request is aborted right there,
the one place cancellation is handled. Tokenization and validation run on the caller's thread
(`prepare`), so a bad request is rejected before it reaches the loop.

Failures: a request that fails inside the engine gets a RequestFailedError and the rest go on
(LLMEngine.step isolates it). If the engine thread itself ends for any reason, every waiting
stream gets an EngineDeadError, and streams also poll the thread's liveness, so no caller waits
on a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from kvserve.core.engine import LLMEngine, PreparedRequest, PromptType, RequestFailedError
from kvserve.engine_config import EngineConfig
from kvserve.errors import KVServeError
from kvserve.metrics import EngineMetrics
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.testing.faults import InjectedEngineDeath

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError"]

LIVENESS_POLL_SECONDS = 0.5


class EngineDeadError(KVServeError):
    """The engine failed to start or stopped; requests cannot be served."""


@dataclass
class _Add:
    prepared: PreparedRequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    error: BaseException


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)


class AsyncEngine:
    def __init__(self, config: EngineConfig, model_name: str | None = None):
        self.config = config
        self.engine: LLMEngine | None = None
        self.metrics = EngineMetrics(model_name or config.model)
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._last_token_time: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.load_seconds: float | None = None
        self._dead = False  # the engine thread ended (crash or stop)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.startup_error is None and not self._dead

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.is_alive

    def stop(self, timeout: float = 120.0) -> None:
        """Stop after the current step (a thread killed inside torch aborts the process)."""
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight with `error` (on the engine thread, between steps);
        used when the shutdown grace period runs out."""
        self._commands.put(_FailAll(error))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # ---- requests (called from the event loop) -------------------------------------------
    def prepare(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0) -> PreparedRequest:
        if not self.is_ready or self.engine is None:
            raise EngineDeadError("the engine is not ready")
        return self.engine.prepare_request(request_id, prompt, params, priority)

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs until finished; closing the stream early aborts the request."""
        if not self.is_ready:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = prepared.request_id
        self._streams[request_id] = (loop, outputs)
        self._commands.put(_Add(prepared))
        finished = False
        try:
            while True:
                item = await self._next(outputs)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _next(self, outputs: asyncio.Queue):
        """The next item for a stream; an EngineDeadError if the engine thread is gone."""
        while True:
            try:
                return await asyncio.wait_for(outputs.get(), LIVENESS_POLL_SECONDS)
            except asyncio.TimeoutError:
                if not self._thread.is_alive() and outputs.empty():
                    return EngineDeadError("the engine stopped while serving this request")

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            start = time.perf_counter()
            self.engine = LLMEngine(self.config)
            self._warm_up()
            self.load_seconds = time.perf_counter() - start
            self.ready.set()
            logger.info("engine warmed up and ready (%.1fs)", self.load_seconds)
        except BaseException as exc:  # surfaced through /health and startup logs
            logger.exception("engine failed to start")
            self.startup_error = exc
            self.ready.set()
            return
        error = EngineDeadError("the server is shutting down")
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                self.metrics.record_engine_state(self.engine)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # the thread is ending: nobody may wait on it
            logger.critical("engine thread died: %s: %s", type(exc).__name__, exc,
                            exc_info=not isinstance(exc, InjectedEngineDeath))
            error = EngineDeadError(f"the engine stopped: {type(exc).__name__}")
        finally:
            self._dead = True
            self._fail_all(error)

    def _warm_up(self) -> None:
        engine = self.engine
        engine.add_request("__warmup__", {"prompt_token_ids": [1, 2, 3, 4]},
                           SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.kv_manager.reset_prefix_cache()

    def _drain_commands(self, block: bool) -> None:
        """Apply every queued command; when idle, wait briefly for one (None only wakes us)."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is not None:
                self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command) -> None:
        if isinstance(command, _FailAll):
            self._fail_all(command.error)
            return
        if isinstance(command, _Abort):
            if command.request_id in self.engine.groups:
                self.engine.abort_request(command.request_id)
                self.metrics.record_aborted()
            self._last_token_time.pop(command.request_id, None)
            return
        prepared = command.prepared
        if prepared.request_id not in self._streams:
            self.metrics.record_aborted()  # the client left before the request was admitted
            return
        try:
            self.engine.add_prepared(prepared)
            self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        except KVServeError as exc:
            self._deliver(prepared.request_id, exc)

    def _step(self) -> None:
        engine = self.engine
        engine.faults.maybe_raise("engine_thread", [g.prompt for g in engine.groups.values()])
        try:
            outputs = engine.step()
        except Exception as exc:  # not attributable to one request (step isolates those)
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(RequestFailedError(f"the engine failed while running this request: "
                                              f"{type(exc).__name__}: {exc}"))
            return
        for request_id, error in engine.take_failures():
            self._last_token_time.pop(request_id, None)
            self.metrics.record_failed()
            self._deliver(request_id, error)
        now = time.monotonic()
        for output in outputs:
            self._observe_tokens(output, now)
            if output.finished:
                self.metrics.record_finished(output)
        self._deliver_many([(output.request_id, output) for output in outputs])
        self.metrics.record_engine_state(self.engine)

    def _observe_tokens(self, output: RequestOutput, now: float) -> None:
        count = sum(len(o.token_ids) for o in output.outputs)
        previous = self._last_token_time.get(output.request_id)
        if previous is None:
            if output.metrics and output.metrics.time_to_first_token is not None:
                self.metrics.ttft.observe(output.metrics.time_to_first_token)
        elif count > previous[0]:
            self.metrics.itl.observe(now - previous[1])
        self.metrics.generation_tokens.inc(count - (previous[0] if previous else 0))
        if output.finished:
            self._last_token_time.pop(output.request_id, None)
        else:
            self._last_token_time[output.request_id] = (count, now)

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_many([(request_id, item)])

    def _deliver_many(self, items: list[tuple[str, object]]) -> None:
        """Hand a step's items to their streams with one wake-up per event loop rather than one
        per stream (each call_soon_threadsafe writes to the loop's self-pipe: at batch 32 that
        was 32 syscalls and loop wake-ups per step on the cores the step needs)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the event loop is closed
                pass

    def _fail_all(self, error: BaseException) -> None:
        """Every waiting stream gets `error` first (so none hangs even if the engine's state is
        broken), then the engine drops its requests."""
        self._deliver_many([(request_id, error) for request_id in list(self._streams)])
        self._last_token_time.clear()
        engine = self.engine
        if engine is not None:
            engine.abort_request(list(engine.groups))
            self.metrics.record_engine_state(engine)
