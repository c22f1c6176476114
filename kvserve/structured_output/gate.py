"""Constrained requests wait for their grammar out of the schedule (vLLM's WAITING_FOR_FSM).

A grammar's first compile can take seconds (xgrammar expands bounded repetition: a string
with maxLength 80 took ~3.5 s on a shared Zen 3). A request scheduled before its grammar is
ready would stall the whole batch when its row first samples, so the engine core asks the
gate as a request arrives; a request whose grammar is not compiled yet waits in the
scheduler's `compiling` set, and the core moves it to the queue once `poll` reports it ready,
or fails it when the compile fails or runs past the compiler's time limit."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._compiling: dict[str, tuple[Future, float]] = {}  # id -> (compile, since)

    def __len__(self) -> int:
        return len(self._compiling)

    def must_wait(self, request_id: str, spec: StructuredOutputsParams) -> bool:
        """Start (or join) the spec's compile; True when the request has to wait for it."""
        future = self.compiler.submit(spec)
        if future.done() and future.exception() is None:
            return False
        self._compiling[request_id] = (future, time.monotonic())
        return True

    def poll(self) -> tuple[list[str], list[tuple[str, Exception]]]:
        """Requests whose grammar is ready, and those whose compile failed or ran too long
        (with why); neither is asked about again."""
        ready, failed = [], []
        now = time.monotonic()
        for request_id, (future, since) in list(self._compiling.items()):
            if future.done():
                error = future.exception()
                (failed.append((request_id, error)) if error is not None
                 else ready.append(request_id))
            elif now - since > self.compiler.timeout_s:
                failed.append((request_id, self.compiler.too_slow()))
            else:
                continue
            del self._compiling[request_id]
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Sleep until a compile ends or `timeout_s` passes (an engine with nothing else to
        run must not spin beside the compile: it would take the compile's core)."""
        if self._compiling:
            wait_futures([future for future, _ in self._compiling.values()], timeout_s,
                         FIRST_COMPLETED)

    def discard(self, request_ids) -> None:
        for request_id in request_ids:
            self._compiling.pop(request_id, None)
