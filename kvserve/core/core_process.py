"""The engine core in its own process: a busy loop between two ZeroMQ sockets.

    drain the input socket (requests, aborts, utility calls; block only while idle)
    -> EngineCore.step() -> push one EngineCoreOutputs (the step's deltas and stats)

The front-end starts it as `python -m kvserve.core.core_process IN OUT PARENT_PID LOG_LEVEL`
with the EngineConfig as JSON on stdin (core_client.py says why not multiprocessing). It
connects to the sockets the front-end bound, builds and warms the core, and answers with a
CoreReady (or a CoreFailed saying why it could not start). It exits when told (Shutdown), and
on its own when the front-end process goes away, however it went. An error it cannot go on
from (a dead worker) is sent as a CoreDying first, so the front-end fails its streams before
the core has stopped its other workers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import zmq

from kvserve.engine_config import EngineConfig
from kvserve.platform import exit_when_parent_dies
from kvserve.protocol.engine_core import (
    AbortRequests,
    Codec,
    CoreDying,
    CoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

# how long a final message may wait for the front-end before the process exits anyway
_LINGER_MS = 2000


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_pid: int, log_level: int) -> None:
    """Serve as the engine core until Shutdown (or the parent's death)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front-end's to handle
    exit_when_parent_dies(parent_pid)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, _LINGER_MS)
    outputs.connect(output_address)
    codec = Codec()
    try:
        from kvserve.core.engine_core import EngineCore

        core = EngineCore(config)
        core.warm_up()
    except BaseException as exc:  # reported to the front-end, which raises it for the user
        logger.exception("engine core failed to start")
        outputs.send(codec.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        outputs.close()
        context.term()
        sys.exit(1)
    outputs.send(codec.encode(core.ready_info(os.getpid())))
    try:
        CoreLoop(core, inputs, outputs, codec).run()
    except BaseException as exc:
        # say so before stopping the workers: a rank stuck in a collective with a dead peer
        # takes seconds to stop, and the front-end's streams should not wait for it
        logger.exception("engine core failed")
        outputs.send(codec.encode(CoreDying(f"{type(exc).__name__}: {exc}")))
        raise
    finally:
        core.shutdown()
        outputs.close()
        inputs.close(linger=0)
        context.term()


class CoreLoop:
    def __init__(self, core, inputs: zmq.Socket, outputs: zmq.Socket, codec: Codec):
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.codec = codec
        self.running = True
        self._applied = False  # the last drain applied a message

    def run(self) -> None:
        """Until Shutdown. An exception no request owns fails the requests in flight and the
        loop goes on; anything worse (a BaseException) ends the process, and the front-end,
        watching it, fails its streams."""
        core = self.core
        idle_reported = True  # the ready message said everything there is to say
        while self.running:
            self._drain(block=idle_reported and not core.has_unfinished(),
                        timeout=core.idle_poll_seconds())
            if not self.running:
                return
            freed = core.housekeeping()  # held KV blocks pulled or expired
            if core.has_unfinished():
                self._send(self._step())
                idle_reported = False
            elif not idle_reported or self._applied or freed:
                # the last step (or an abort) left the core idle: one stats-only message, so
                # the front-end's gauges (KV blocks in use) show it
                self._send(EngineCoreOutputs([], core.stats()))
                idle_reported = True

    def _step(self) -> EngineCoreOutputs:
        try:
            return self.core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            return self.core.fail_all("running this request", exc)

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        """Apply every message waiting; while idle, wait for the first one (at most `timeout`
        seconds when housekeeping is due)."""
        self._applied = False
        if block:
            self.inputs.poll(None if timeout is None else int(timeout * 1000))
        while self.running:
            try:
                data = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._apply(self.codec.decode_input(data.buffer))
            self._applied = True

    def _apply(self, message) -> None:
        core = self.core
        if isinstance(message, EngineCoreRequest):
            core.add_request(message)
        elif isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            self._send(self._utility(message))
        elif isinstance(message, Shutdown):
            self.running = False

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in self.core.UTILITIES:
            return UtilityResult(call.call_id, error=f"no utility {call.method!r}")
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except Exception as exc:
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _send(self, message) -> None:
        self.outputs.send(self.codec.encode(message), copy=False)


def main(argv: list[str]) -> None:
    input_address, output_address, parent_pid, log_level = argv
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_engine_core(config, input_address, output_address, int(parent_pid), int(log_level))


if __name__ == "__main__":
    main(sys.argv[1:])
