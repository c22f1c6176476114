"""Starting kvserve's own child processes (the engine core, executor workers).

`python -m <module>` in a fresh interpreter (no inherited threads or OpenMP state), with the
EngineConfig as JSON on stdin. Unlike multiprocessing's spawn it never re-imports the user's
__main__, so a script that builds an LLM at top level without a `__main__` guard does not start
processes recursively. The child imports the same kvserve as its parent, and watches the parent
itself (platform.exit_when_parent_dies).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

import kvserve

SHUTDOWN_GRACE_SECONDS = 5.0


def start_module_process(module: str, args: list[str], config) -> subprocess.Popen:
    package_root = str(Path(kvserve.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    process = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                               env=env)
    try:
        process.stdin.write(msgspec.json.encode(config))
        process.stdin.close()
    except BrokenPipeError:  # it died at once; the caller's start-up wait reports how
        pass
    return process


def stop_process(process: subprocess.Popen, grace: float = SHUTDOWN_GRACE_SECONDS) -> None:
    """Wait for a process asked to stop; terminate it, then kill it, if it does not; reap it."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None and process.poll() is None:
            stop()
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        import signal

        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def close_sockets(context, sockets) -> None:
    """Close `sockets` without lingering, then the ZeroMQ context. Sockets are passed by name:
    Context.destroy() finds them through a weak set, which garbage collection may already have
    emptied, and Context.term() then waits forever for sockets nobody can close."""
    for socket in sockets:
        socket.close(linger=0)
    context.term()
