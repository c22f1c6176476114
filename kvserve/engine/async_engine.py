"""AsyncEngine: the LLMEngine fed and drained from asyncio, with the core on a thread or in a
process of its own (`EngineConfig.engine_core`).

Callers `generate()` an async stream; when the stream is closed early (a client went away) the
request is aborted right there, the one place cancellation is handled. Tokenization and
validation run on the caller's thread (`prepare`), so a bad request is rejected before it
reaches the core.

One "engine thread" drives it, the same way whichever the core: it asks the core client for
the next step's outputs (`get_outputs`: an in-process core is stepped right there, a process
core's outputs are read from its socket), turns them into RequestOutputs under the front-end's
lock and hands them to the streams. Adds and aborts take the same lock on the caller's thread
and go to the client (which queues them for an in-process core's next step, or sends them to
the process core's socket).

Failures: a request that fails inside the engine gets a RequestFailedError and the rest go on.
If the core dies (its thread or process ended, however), every waiting stream gets an
EngineDeadError at once and /health turns 503; then the core is restarted
(`restart_engine_on_failure`, at most `max_engine_restarts` times) or `fatal_error` is set so
the server exits non-zero and an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.llm_engine import LLMEngine, PreparedRequest, PromptType
from kvserve.engine.lora_registry import LoadedLoRA
from kvserve.engine.output_processor import StepProgress
from kvserve.engine_config import EngineConfig
from kvserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    KVServeError,
    RequestFailedError,
)
from kvserve.lora_request import LoRARequest
from kvserve.metrics import EngineMetrics
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.engine_core import SchedulerStats
from kvserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError"]

LIVENESS_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the model source's name
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int


def _settle(done: asyncio.Future, result, error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)


class AsyncEngine:
    def __init__(self, config: EngineConfig, model_name: str | None = None,
                 restart_on_failure: bool = False, max_restarts: int = 3,
                 lora_modules: Sequence[LoRARequest] = ()):
        """`lora_modules`: adapters loaded with the engine (--lora-modules), and again after a
        restart, like those loaded at run time."""
        self.config = config
        self.engine: LLMEngine | None = None
        self.metrics = EngineMetrics(model_name or config.model)
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self.fatal_error: BaseException | None = None  # the core died for good
        self.restart_on_failure = restart_on_failure
        self.max_restarts = max_restarts
        self.num_restarts = 0
        self._lock = threading.Lock()  # the front-end's state and the core client's senders
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._last_token_time: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.load_seconds: float | None = None
        self._serving = False  # a core is up and taking requests
        # LoRA adapters by name, loaded again on a restarted core; calls the engine thread
        # runs between steps (the core client has one reader: that thread)
        self._lora_requests: dict[str, LoRARequest] = {r.lora_name: r for r in lora_modules}
        self._engine_calls: queue.SimpleQueue = queue.SimpleQueue()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.startup_error is None \
            and self.fatal_error is None

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.is_alive and self._serving

    def stop(self, timeout: float = 120.0) -> None:
        """Stop after the current step (a thread killed inside torch aborts the process), then
        the core (its process is reaped)."""
        self._stop.set()
        engine = self.engine
        if engine is not None:
            engine.core.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight with `error`; used when the shutdown grace period runs
        out."""
        with self._lock:
            self._fail_all(error)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # ---- what the server may ask (the engine client API; never reach into `engine`) -------
    def model_info(self) -> ModelInfo | None:
        """The loaded model's name and limits; None while no core is up."""
        engine = self.engine
        if engine is None:
            return None
        return ModelInfo(engine.source.name, engine.max_model_len, engine.vocab_size,
                         engine.core.ready.num_kv_blocks)

    def last_stats(self) -> SchedulerStats | None:
        """The core's scheduler stats as of its last step."""
        return self.engine.last_stats if self.engine is not None else None

    @property
    def inputs(self) -> InputProcessor:
        """Chat templates, tokenizing and validation for the loaded model."""
        if not self.is_ready or self.engine is None:
            raise EngineDeadError("the engine is not ready")
        return self.engine.inputs

    def detokenize(self, token_ids: list[int]) -> str:
        inputs = self.inputs
        vocab = inputs.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})",
                                      param="tokens")
        return inputs.tokenizer.decode(token_ids, False)

    # ---- LoRA adapters (called from the event loop) ---------------------------------------
    def lora(self, name: str) -> LoadedLoRA | None:
        """The loaded adapter of that name, if any (what a request's `model` may name)."""
        engine = self.engine
        if engine is None or not self.is_ready:
            return None
        return next((l for l in engine.loras.loaded() if l.name == name), None)

    def loras(self) -> list[LoadedLoRA]:
        engine = self.engine
        return engine.loras.loaded() if engine is not None and self.is_ready else []

    async def add_lora(self, request: LoRARequest) -> LoadedLoRA:
        """Load an adapter (InvalidRequestError when it cannot be: checked before any worker
        sees it); requests may name it once this returns."""
        loaded = await self._on_engine_thread(lambda engine: engine.loras.add(request))
        self._lora_requests[request.lora_name] = request
        return loaded

    async def remove_lora(self, name: str) -> None:
        """New requests can no longer name it; those running finish on it (LoRANotFoundError
        when none of that name is loaded)."""
        await self._on_engine_thread(lambda engine: engine.loras.remove(name))
        self._lora_requests.pop(name, None)

    async def _on_engine_thread(self, call):
        """`call(engine)` on the engine thread, between steps; its result or its error."""
        if not self.is_ready or self.engine is None:
            raise EngineDeadError("the engine is not ready")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._engine_calls.put((call, loop, done))
        self.engine.core.wake()
        return await done

    def _run_engine_calls(self, engine: LLMEngine | None) -> None:
        while True:
            try:
                call, loop, done = self._engine_calls.get_nowait()
            except queue.Empty:
                return
            try:
                if engine is None:
                    raise EngineDeadError("the engine stopped")
                result, error = call(engine), None
            except Exception as exc:  # the caller's error to raise, not the engine's
                result, error = None, exc
            loop.call_soon_threadsafe(_settle, done, result, error)

    # ---- requests (called from the event loop) -------------------------------------------
    def prepare(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0, kv_transfer_params=None,
                cache_salt: str | None = None,
                session_id: str | None = None,
                lora: LoadedLoRA | None = None) -> PreparedRequest:
        if not self.is_ready or self.engine is None:
            raise EngineDeadError("the engine is not ready")
        return self.engine.prepare_request(request_id, prompt, params, priority,
                                           kv_transfer_params=kv_transfer_params,
                                           cache_salt=cache_salt, session_id=session_id,
                                           lora=lora)

    def prepare_pooling(self, request_id: str, prompt: PromptType,
                        pooling_params: PoolingParams | None = None,
                        priority: int = 0) -> PreparedRequest:
        """A pooling request (--runner pooling) ready for `generate`, whose one output is a
        PoolingRequestOutput; InvalidRequestError on a generate runner or for bad input."""
        if not self.is_ready or self.engine is None:
            raise EngineDeadError("the engine is not ready")
        return self.engine.prepare_pooling_request(request_id, prompt, pooling_params,
                                                   priority)

    async def validate_grammar(self, params: SamplingParams) -> None:
        """A structured-output request's grammar, checked off the event loop (xgrammar's
        first import takes seconds); an InvalidRequestError when it cannot be used. The
        engine core compiles it, holding the request until it is ready."""
        if params.structured_outputs is not None:
            from kvserve.structured_output.compiler import validate_async

            await validate_async(params.structured_outputs)

    async def generate(self, prepared: PreparedRequest,
                       output_kind: RequestOutputKind | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs until finished; closing the stream early aborts the request.
        `output_kind`, when given, replaces the one in the request's params: how the caller
        reads its outputs (deltas, or the final one only)."""
        if not self.is_ready:
            raise EngineDeadError("the engine is not running")
        if output_kind is not None and output_kind != prepared.params.output_kind:
            params = copy.copy(prepared.params)
            params.output_kind = output_kind
            prepared = dataclasses.replace(prepared, params=params)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = prepared.request_id
        self._streams[request_id] = (loop, outputs)
        self._add(prepared)
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
        """The next item for a stream; an EngineDeadError if the engine thread is gone. An item
        already waiting is taken at once, and a wait is bounded by `asyncio.timeout`, a timer:
        `wait_for` wrapped every token's wait in a task of its own, on the cores the step
        needs."""
        if not outputs.empty():
            return outputs.get_nowait()
        while True:
            try:
                async with asyncio.timeout(LIVENESS_POLL_SECONDS):
                    return await outputs.get()
            except TimeoutError:
                if not self._thread.is_alive() and outputs.empty():
                    return EngineDeadError("the engine stopped while serving this request")

    def _add(self, prepared: PreparedRequest) -> None:
        with self._lock:
            self._admit(prepared)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._apply_abort(request_id)

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        """Start a core, serve until it dies or we stop; restart while allowed."""
        while not self._stop.is_set():
            if not self._start_engine():
                return
            error = self._serve()
            if self._stop.is_set():
                break
            if not self.restart_on_failure or self.num_restarts >= self.max_restarts:
                logger.critical("engine core is dead and will not be restarted: %s", error)
                self.fatal_error = error
                break
            self.num_restarts += 1
            logger.warning("restarting the engine core (%d of at most %d)", self.num_restarts,
                           self.max_restarts)
        self._shutdown_engine()

    def _start_engine(self) -> bool:
        try:
            start = time.perf_counter()
            self._shutdown_engine()
            self.engine = LLMEngine(self.config, warm_up=True)
            for lora in self._lora_requests.values():  # --lora-modules, and run-time loads
                self.engine.loras.add(lora)
            self.load_seconds = time.perf_counter() - start
            self._serving = True
            self.ready.set()
            logger.info("engine warmed up and ready (%.1fs)", self.load_seconds)
            return True
        except BaseException as exc:  # surfaced through /health and startup logs
            logger.exception("engine failed to start")
            if self.num_restarts:
                self.fatal_error = exc
            else:
                self.startup_error = exc
            self.ready.set()
            return False

    def _shutdown_engine(self) -> None:
        engine = self.engine
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine core shutdown failed")

    def _serve(self) -> BaseException:
        """Serve until the core dies or we are told to stop; returns what ended it. Every
        stream waiting then has its error."""
        error: BaseException = EngineDeadError("the server is shutting down")
        try:
            self._serve_core()
        except BaseException as exc:  # the core is gone: nobody may wait on it
            logger.critical("engine core died: %s: %s", type(exc).__name__, exc,
                            exc_info=not isinstance(exc, EngineDeadError))
            error = exc if isinstance(exc, EngineDeadError) else \
                EngineDeadError(f"the engine stopped: {type(exc).__name__}")
        finally:
            self._serving = False
            with self._lock:
                self._fail_all(error)
            self._run_engine_calls(None)  # each call waiting fails: no engine to run it
        return error

    def _serve_core(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._run_engine_calls(engine)
            core_outputs = engine.core.get_outputs(LIVENESS_POLL_SECONDS)
            if core_outputs is None:
                continue
            with self._lock:
                self._deliver_step(engine.process_outputs(core_outputs))
            self.metrics.record_engine_state(engine.last_stats)

    def _apply_abort(self, request_id: str) -> None:
        engine = self.engine
        if engine is not None and request_id in engine.groups:
            engine.abort_request(request_id)
            self.metrics.record_aborted()
        self._last_token_time.pop(request_id, None)

    def _admit(self, prepared: PreparedRequest) -> None:
        if prepared.request_id not in self._streams:
            self.metrics.record_aborted()  # the client left before the request was admitted
            return
        try:
            if not self._serving:
                raise EngineDeadError("the engine is not running")
            self.engine.add_prepared(prepared)
            self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        except KVServeError as exc:
            self._deliver(prepared.request_id, exc)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs and failures to their streams, and count them."""
        for request_id, error in self.engine.take_failures():
            self._last_token_time.pop(request_id, None)
            self.metrics.record_failed()
            self._deliver(request_id, error)
        now = time.monotonic()
        totals = {}
        for progress in self.engine.last_progress:
            self._observe_tokens(progress, now)
            totals[progress.request_id] = progress.num_output_tokens
        for output in outputs:
            if output.finished:
                self.metrics.record_finished(output, totals.get(output.request_id, 0))
        self._deliver_many([(output.request_id, output) for output in outputs])

    def _observe_tokens(self, progress: StepProgress, now: float) -> None:
        """TTFT, inter-token latency and the token counter, from the request's running total
        (its outputs may carry only a delta, or nothing until the end)."""
        count = progress.num_output_tokens
        previous = self._last_token_time.get(progress.request_id)
        if previous is None:
            if count and progress.time_to_first_token is not None:
                self.metrics.ttft.observe(progress.time_to_first_token)
        elif count > previous[0]:
            self.metrics.itl.observe(now - previous[1])
        self.metrics.generation_tokens.inc(count - (previous[0] if previous else 0))
        if progress.finished:
            self._last_token_time.pop(progress.request_id, None)
        elif count:  # a step with no token yet (a prefill chunk) starts no interval
            self._last_token_time[progress.request_id] = (count, now)

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
        if engine is None:
            return
        try:
            engine.abort_request(list(engine.groups))
        except EngineDeadError:  # its core is gone; the requests are forgotten here already
            pass
